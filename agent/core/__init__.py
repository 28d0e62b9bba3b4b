"""The core: leaf modules every layer may import, and which import nothing above them.

config.py     the site config (and its compiled JSON for the hooks)
gpuconfig.py  the config's ``gpu:`` section
reference.py  image references, parsed strictly (pure)
errors.py     every exception, in one tree
wire.py       every name and message that crosses a process boundary
layout.py     the node's state and cache directories, file by file
ids.py        job ids and digests, the one sha256 pattern
fsutil.py     the one lock and the one atomic writer
deadline.py   a hook's deadline
logtext.py    untrusted text made one safe log line
sif.py        the SIF header, read strictly
toolrun.py    an external tool with a deadline and no shell
"""
