"""The `tinkerflow` command: `up` runs everything; each part also starts alone."""
