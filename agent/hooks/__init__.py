"""The hooks' shared code: their arguments from the wire's table (args.py), the
never-drain rule and their log (log.py), and the requeue of a job whose slurmd died
under its prolog (orphan.py)."""
