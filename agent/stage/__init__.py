"""One pull per multi-node job: the controller pulls, Slurm's tree fans it out.

job.py      PrologSlurmctld's work for one job: which nodes lack the image, the one
            pull into the staging cache, the broadcast, and why it fell back
sbcast.py   the broadcast: sbcast's command line for this Slurm generation, run as
            the job's user on a descriptor root opened
ledger.py   which nodes each image was sent to, and when (the controller's only
            knowledge of the nodes' caches)

The nodes' side is the cache's (cache/staged.py): a staged copy is checked exactly as
a download before it becomes an image, and a node without a usable one pulls itself.
"""
