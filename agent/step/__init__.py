"""A job step on a node: its plan, runtimes, image mounts, binds, task environment."""
