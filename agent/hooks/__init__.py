"""The hooks' shared code: their arguments from the wire's table (args.py), and the
never-drain rule and their log (log.py)."""
