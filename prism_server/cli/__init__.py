"""The command line: `python -m prism_server` (main.py) and its status command (status.py)."""
