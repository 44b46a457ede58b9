from recserve.cli import main

main()
