from recserve.cli import main

if __name__ == "__main__":  # a spawned serving process imports this module too
    main()
