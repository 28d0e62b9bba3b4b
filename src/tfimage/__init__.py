"""tfimage: run Slurm TensorFlow jobs inside cached, verified SIF images.

The public surface is small on purpose:

- :mod:`tfimage.agent` holds the shared machinery (references, registry, cache,
  runtimes) and the ``tfimage`` operator CLI;
- :mod:`tfimage.prolog` and :mod:`tfimage.epilog` are the Slurm node hooks.

Everything a caller may catch is listed in :mod:`tfimage.agent.core.errors`.
"""

__version__ = "0.1.0"
