"""One thin module per CLI command: its config, the library call, what it prints."""
