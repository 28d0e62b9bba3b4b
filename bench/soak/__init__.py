"""The soak: many short --tf-image jobs with the platform failing underneath, then
an account of every task, every node and everything a job leaves behind.

    python bench/run.py soak [--tasks 2000] [--seed 1] [--nodes 4] [--json]

Needs the local cluster (host flavor, ``make cluster-up``; 4 nodes or more puts the
upper half behind the rack mirror, whose fault then applies).  The soak's nodes are
the last ``--nodes`` of the cluster's.

The work: waves of job arrays, each wave one array per kind, over four images,
both users, throttled (``%4``) so that tasks keep flowing while faults come and go:

    kind     image              user     shape    what runs
    batch    tiny:1.0           first    1 task   the batch script, in the image
    steps    tf-custom:2.0      first    2 tasks  srun steps from a host script
    multi    soak-<seed>:1      first    2 nodes  srun steps on both nodes
    mount    team-a/tiny:1.0    first    1 task   reads a --tf-mount'ed file
    other    tiny:1.0           second   1 task   the batch script, in the image

The faults (seeded; one at a time, each kind at least once, each logged with its
start and end): the registry stopped (SIGSTOP) and killed (then restarted, as a
service manager would), the rack mirror answering 5xx then hanging, a node's
tfimage daemon killed mid-request (SIGKILL; its worker left running, as the
unit's KillMode=process does) and a node's slurmd killed, both restarted, a
node's cache file system full (a full tmpfs over it), an eviction down to the low watermark
while jobs hold images, and the pin socket flooded by the second user.

The account (a table, or ``--json``): tasks completed, failed with a ``tfimage:``
reason (each reason counted), failed with Slurm's own reason (a fault below
tfimage, such as a slurmd killed under a step's launch), requeued and not run again
by the end (a slurmd killed under a prolog: the prolog requeues the job, which waits
out Slurm's requeue delay), and lost (none of these, which must be 0), with every
task Slurm ran more than once listed; nodes drained (must be 0: no GPU fault is
injected); what the jobs left on each node after the last epilog (mounts, loop
devices, FUSE processes, holds, per-job state, partial downloads, temp files: all
0); usage records against Slurm's accounting (one per try, job and node that ran,
``sacct -D``: duplicates and gaps counted; array ids the task's own), and
``tfimage usage report --by image`` against it (jobs and failures per image); and
throughput with and without a fault, with each fault's cost (how long after it
ended until a task finished again).
"""

from __future__ import annotations

from .account import problems, table
from .faults import FAULTS
from .run import main, soak

__all__ = ["FAULTS", "main", "problems", "soak", "table"]
