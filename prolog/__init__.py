"""Slurm node Prolog (root, once per job per node, ``PrologFlags=Alloc``)."""
