"""The hooks' shared code: the never-drain rule and their log (log.py)."""
