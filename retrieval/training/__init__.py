"""Training the two towers (and optional scoring head) end to end."""
