"""Every name and message that crosses a process boundary, in one place: between the
C plugin (``spank/``) and the Python side, and from Slurm to the hooks.

0. **Names**: the job's control environment (:data:`CONTROL_IMAGE` and the names
   the hooks and steps see it by), plugstack.conf's keys and their defaults
   (:data:`PLUGSTACK_KEYS`; ``spank/args.c`` takes its defaults from wire.h, the
   config its path and deadline from here).

The C side follows this module: ``spank/wire.h`` defines the same constants, and a
unit test parses that header against :data:`C_CONSTANTS`.  A cluster test captures
what the plugin really exchanged in a step (``tfimage daemon --trace``) and checks
it against the parsers here, both ways.

1. **Daemon request** (``spank/client.c`` -> ``agent/daemon/server.py``), one per
   connection: ``MAGIC``, then the helper's arguments (``argv[1:]``), each
   NUL-terminated; then the client shuts down its writing side.  **Answer**: the
   exit status (int32, big-endian; -1: the worker was killed), the length of
   stderr (uint32, big-endian), stderr, then stdout up to EOF.  The root socket
   serves ``step-prepare`` (3) and the node hooks (5); the pin socket, open to
   every local user, serves ``submit-check`` (4) and nothing else.

2. **step-prepare argv** (``spank/node.c`` -> ``agent/cli/plugin.py``)::

       tfimage --config PATH step-prepare --job=N --step=N --uid=N --image=REF
           --node-id=N --local-tasks=N [--workdir=PATH] [--script=PATH]
           [--tf-mount=SPEC] [--gpus] [--array-job=N --array-task=N]
           [--layout=NAME=VALUE ...]

   Every value as ``--name=VALUE``: values are the job's, and one starting with
   ``-`` must stay a value.  :data:`STEP_PREPARE` lists each flag and when the
   plugin sends it.

3. **step-prepare answer**: NUL-separated tokens, each followed by a NUL::

       argv N a1 .. aN        the runtime's argv prefix (a1 absolute)
       src PATH               a --tf-mount host path each task checks, as the user
       env L NAME VALUE       set NAME=VALUE in local task L unless the user did

4. **submit-check** (``spank/submit.c`` -> the pin socket, or the helper)::

       tfimage --config PATH submit-check --tf-mount=SPEC --job-image=REF -- REF

   ``--job-image`` is the pinned image of the job an srun runs in (empty outside
   one).  Answers: 0 and the pinned reference on stdout; 2 the user's input is
   wrong (final); anything else from the pin socket: the plugin pins by itself.

5. **Node hooks** through ``tfimage-hook`` (``spank/hook.c``) to the root socket::

       tfimage-prolog --config=PATH --job=N --image=REF --node=NAME --gpus=LIST --mps=PCT
                      --uid=N --asked=TEXT --partition=P
       tfimage-epilog --config=PATH --job=N --image=REF --asked=TEXT --node=NAME
                      --user=NAME --uid=N --account=A --partition=P --array-job=N
                      --array-task=N --exit=E:S --exit-raw=STATUS --gpus=LIST --mps=PCT

   :data:`HOOK_FLAGS` names the Slurm variable each comes from, and the hooks'
   parsers are built from it (hooks/args.py): the epilog's are Slurm's
   ``SLURM_JOB_*`` and ``SLURM_ARRAY_*`` (``--exit`` is ``SLURM_JOB_EXIT_CODE2``),
   and ``--asked`` the ``--tf-image`` text as the user wrote it, for the usage
   record and the prolog's partition rule (whether it named a digest);
   ``--partition``, ``SLURM_JOB_PARTITION``, picks that rule.  ``--gpus`` and
   ``--mps`` are Slurm's ``SLURM_JOB_GPUS`` (else ``CUDA_VISIBLE_DEVICES``) and
   ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, empty for none.

   The controller's hook, Slurm's ``PrologSlurmctld`` (stage/), the same way::

       tfimage-stage --config=PATH --job=N --image=REF --nodes=HOSTLIST --uid=N --gid=N
                     --asked=TEXT --partition=P

   ``--nodes`` is ``SLURM_JOB_NODELIST``, Slurm's compact list, counted before it is
   expanded; ``--uid`` and ``--gid`` the job owner's, whom the broadcast runs as;
   ``--asked`` and ``--partition`` as the prolog's (an image the partition refuses
   is not staged).
   Its front (the role's ``tfimage-stage`` script) starts nothing for a job without
   ``--tf-image`` or on one node (``SLURM_JOB_NUM_NODES``), and asks the daemon's
   stage socket (Slurm's user's: ``PrologSlurmctld`` runs as that user).

   ``tfimage-hook SOCKET DEADLINE PROGRAM ARGS...`` waits ``DEADLINE`` +
   :data:`HOOK_GRACE` seconds, and runs ``PROGRAM`` itself only when no daemon
   listens.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tfimage.agent.core.errors import RequestError

MAGIC = b"TFI1\0"
ANSWER_HEADER = struct.Struct(">iI")
# The most stdout the plugin takes in one answer (step-prepare's tokens).
MAX_ANSWER = 1 << 20
# Seconds a caller waits beyond the config's hook_deadline for the helper or a hook
# to say it gave up (the daemon kills a worker two thirds of the way through).
HOOK_GRACE = 30
# The pin server's answer when its slots are taken (EX_TEMPFAIL): the plugin asks
# again, within its share of submit_timeout, before it pins by itself.
PIN_BUSY = 75

STEP_PREPARE = "step-prepare"
SUBMIT_CHECK = "submit-check"
HOOKS = ("tfimage-prolog", "tfimage-epilog", "tfimage-stage")
STAGE_HOOK = "tfimage-stage"

# -- 0. names that cross a process boundary outside the messages ---------------------

# The job's control environment, set at submit (spank_job_control_setenv): the
# prolog and epilog see it as SPANK_<NAME>, the batch step and its sruns as
# SLURM_SPANK_<NAME> (which is how an srun inside a job inherits the image).
CONTROL_IMAGE = "TFIMAGE_IMAGE"
PROLOG_IMAGE_VAR = "SPANK_" + CONTROL_IMAGE
STEP_IMAGE_VAR = "SLURM_SPANK_" + CONTROL_IMAGE
# The --tf-image text as the user wrote it, as Slurm hands SPANK options to hooks.
ASKED_IMAGE_VAR = "SPANK__SLURM_SPANK_OPTION_tfimage_tf_image"
# Where the CLI finds the config when --config is not given.
CONFIG_VAR = "TFIMAGE_CONFIG"

# plugstack.conf's arguments (spank/args.c) and their defaults.  The config's own
# defaults (core/config.py) take the path and the deadline from here.
DEFAULT_CONFIG = "/etc/tfimage/config.yaml"
DEFAULT_HELPER = "/opt/tfimage/bin/tfimage"
DEFAULT_SUBMIT_TIMEOUT = 30
# The submit side's timeouts, derived here and nowhere else: the plugin gives the pin
# server half of submit_timeout (spank/submit.c) and its own helper what is left.
# A pin asks the registry for two thirds of that half at most, so that a registry
# which accepts and never answers (stopped, overloaded) still leaves the pin time
# to answer with the digest this host last saw, and its warning.
PIN_SERVER_SHARE = DEFAULT_SUBMIT_TIMEOUT / 2
PIN_REGISTRY_SECONDS = PIN_SERVER_SHARE * 2 / 3
DEFAULT_HOOK_DEADLINE = 600  # the config's hook_deadline; prepare_timeout adds HOOK_GRACE
# The admin's kill switch: a file of this name beside the config, whose first line
# says why, turns --tf-image off for new submissions; what is queued or running goes
# on (the plugin checks it at submit only, and not for an srun inside such a job).
OFF_SWITCH = "submit.off"
# The controller's: a file of this name beside the config turns the stage hook off
# at once (its front exits before anything starts), where Slurm 22.05 would need
# slurmctld restarted to drop the PrologSlurmctld line.
STAGE_OFF_SWITCH = "stage.off"

PLUGSTACK_KEYS = (
    "helper",
    "config",
    "daemon",
    "pin_socket",
    "submit_timeout",
    "prepare_timeout",
    "state_dir",
)


@dataclass(frozen=True)
class HookFlag:
    """One argument of a node hook (5): its flag, the Slurm variables it comes from
    (the first one set wins, as the role's scripts write ``${A:-${B:-}}``), and the
    name the hook (and the usage record) gives it."""

    name: str
    env: tuple[str, ...]
    dest: str


_JOB = HookFlag("--job", ("SLURM_JOB_ID",), "job_id")
_IMAGE = HookFlag("--image", (PROLOG_IMAGE_VAR,), "image")
_NODE = HookFlag("--node", ("SLURMD_NODENAME",), "node")
# The job's GPUs: node-wide indices or UUIDs (gpu/alloc.py).
_GPUS = HookFlag("--gpus", ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"), "gpus")
_MPS = HookFlag("--mps", ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",), "mps")
# The job's user as slurmd gives it (never the job's own environment): whose access
# the prolog checks (core/access.py) and whose usage the epilog records.
_UID = HookFlag("--uid", ("SLURM_JOB_UID",), "uid")
_GID = HookFlag("--gid", ("SLURM_JOB_GID",), "gid")
_NODES = HookFlag("--nodes", ("SLURM_JOB_NODELIST",), "nodes")
# A node's prolog: SLURM_JOB_NODELIST from 23.02.6, SLURM_NODELIST on every version.
_JOB_NODES = HookFlag("--nodes", ("SLURM_JOB_NODELIST", "SLURM_NODELIST"), "nodes")
_ASKED = HookFlag("--asked", (ASKED_IMAGE_VAR,), "image_asked")
# The partition the job runs in, as slurmd gives it: what picks a partitions: rule.
_PARTITION = HookFlag("--partition", ("SLURM_JOB_PARTITION",), "partition")

# Each hook's arguments after ``--config=PATH``, in the order the role's scripts
# send them (5); tests/unit/deploy/test_hook_scripts.py holds the scripts to it.
HOOK_FLAGS: dict[str, tuple[HookFlag, ...]] = {
    "tfimage-prolog": (_JOB, _IMAGE, _NODE, _GPUS, _MPS, _UID, _ASKED, _PARTITION, _JOB_NODES),
    "tfimage-epilog": (
        _JOB,
        _IMAGE,
        _ASKED,
        _NODE,
        HookFlag("--user", ("SLURM_JOB_USER",), "user"),
        _UID,
        HookFlag("--account", ("SLURM_JOB_ACCOUNT",), "account"),
        _PARTITION,
        HookFlag("--array-job", ("SLURM_ARRAY_JOB_ID",), "array_job_id"),
        HookFlag("--array-task", ("SLURM_ARRAY_TASK_ID",), "array_task_id"),
        HookFlag("--exit", ("SLURM_JOB_EXIT_CODE2",), "exit"),
        HookFlag("--exit-raw", ("SLURM_JOB_EXIT_CODE",), "exit_raw"),
        _GPUS,
        _MPS,
    ),
    STAGE_HOOK: (_JOB, _IMAGE, _NODES, _UID, _GID, _ASKED, _PARTITION),
}


def hook_default(flag: HookFlag, environ: Mapping[str, str]) -> str:
    """The flag's value when the hook runs without it (directly as Slurm's Prolog)."""
    return next((environ[v] for v in flag.env if environ.get(v)), "")


TOK_ARGV, TOK_SRC, TOK_ENV = "argv", "src", "env"

# The step variables the plugin passes with --layout; everything else is refused.
LAYOUT_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_STEP_RESV_PORTS",
    # fractional GPUs (step/gpushare.py): the step's GPUs, its MPS share, --mem-per-gpu
    "SLURM_STEP_GPUS",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "SLURM_MEM_PER_GPU",
)


@dataclass(frozen=True)
class Flag:
    """One step-prepare flag: its name, whether it takes a value, and when the
    plugin sends it (``always``, or the condition)."""

    name: str
    value: bool
    sent: str


STEP_PREPARE_FLAGS = (
    Flag("--job", True, "always"),
    Flag("--step", True, "always"),
    Flag("--uid", True, "always"),
    Flag("--image", True, "always"),
    Flag("--node-id", True, "always"),
    Flag("--local-tasks", True, "always"),
    Flag("--workdir", True, "when the task's working directory is known"),
    Flag("--script", True, "for the batch step run in the image"),
    Flag("--tf-mount", True, "when the job gave --tf-mount"),
    Flag("--gpus", False, "when Slurm allocated GPUs to the step"),
    # slurmd gives Prolog and Epilog no SLURM_ARRAY_* on 22.05: the step, which has
    # them from Slurm itself (not the job's environment), hands them to the record.
    Flag("--array-job", True, "for a task of a job array (Slurm's S_JOB_ARRAY_ID)"),
    Flag("--array-task", True, "with --array-job (S_JOB_ARRAY_TASK_ID)"),
    Flag("--layout", True, "once per step variable the step has (LAYOUT_VARS)"),
)

SUBMIT_CHECK_FLAGS = (
    Flag("--tf-mount", True, "always (empty when the job gave none)"),
    Flag("--job-image", True, "always (empty outside a job)"),
)

# What spank/wire.h must define, name for name (tests/unit/core/test_wire.py).
C_CONSTANTS: dict[str, str | int] = {
    "TFI_WIRE_MAGIC": MAGIC[:-1].decode(),
    "TFI_HOOK_GRACE": HOOK_GRACE,
    "TFI_PIN_BUSY": PIN_BUSY,
    "TFI_MAX_ANSWER": MAX_ANSWER,
    "TFI_CMD_STEP_PREPARE": STEP_PREPARE,
    "TFI_CMD_SUBMIT_CHECK": SUBMIT_CHECK,
    "TFI_TOK_ARGV": TOK_ARGV,
    "TFI_TOK_SRC": TOK_SRC,
    "TFI_TOK_ENV": TOK_ENV,
    "TFI_CONTROL_IMAGE": CONTROL_IMAGE,
    "TFI_STEP_IMAGE_VAR": STEP_IMAGE_VAR,
    "TFI_DEFAULT_CONFIG": DEFAULT_CONFIG,
    "TFI_OFF_SWITCH": OFF_SWITCH,
    "TFI_DEFAULT_HELPER": DEFAULT_HELPER,
    "TFI_DEFAULT_SUBMIT_TIMEOUT": DEFAULT_SUBMIT_TIMEOUT,
    "TFI_DEFAULT_HOOK_DEADLINE": DEFAULT_HOOK_DEADLINE,
    **{
        "TFI_ARG_" + f.name[2:].upper().replace("-", "_"): f.name + ("=" if f.value else "")
        for f in STEP_PREPARE_FLAGS + SUBMIT_CHECK_FLAGS
    },
    **{f"TFI_LAYOUT_{i}": v for i, v in enumerate(LAYOUT_VARS)},
}


# -- 1. the daemon's framing ---------------------------------------------------------


def encode_request(args: Sequence[str]) -> bytes:
    return MAGIC + b"".join(a.encode("utf-8", "surrogateescape") + b"\0" for a in args)


def decode_request(data: bytes) -> list[str] | None:
    """A request's arguments; None for an empty one (``tfimage doctor``'s probe)."""
    if not data:
        return None
    if not data.startswith(MAGIC) or not data.endswith(b"\0"):
        raise RequestError("daemon: malformed request")
    return [t.decode("utf-8", "surrogateescape") for t in data[len(MAGIC) : -1].split(b"\0")]


def encode_answer(status: int, err: bytes, out: bytes) -> bytes:
    return ANSWER_HEADER.pack(status, len(err)) + err + out


def decode_answer(data: bytes) -> tuple[int, bytes, bytes]:
    if len(data) < ANSWER_HEADER.size:
        raise RequestError("daemon: short answer")
    status, elen = ANSWER_HEADER.unpack_from(data)
    body = data[ANSWER_HEADER.size :]
    if elen > len(body):
        raise RequestError("daemon: short answer")
    return status, body[:elen], body[elen:]


# -- 2, 3. step-prepare ----------------------------------------------------------------


def step_prepare_flags(args: Sequence[str]) -> list[str]:
    """The flag names a step-prepare argv (after the command word) uses, each checked
    against :data:`STEP_PREPARE_FLAGS`: ``--name=value`` for a valued flag, the bare
    name for the others."""
    known = {f.name: f for f in STEP_PREPARE_FLAGS}
    out = []
    for a in args:
        name, eq, _ = a.partition("=")
        flag = known.get(name)
        if flag is None or flag.value != bool(eq):
            raise RequestError(f"step-prepare: unexpected argument {a[:40]!r}")
        out.append(name)
    return out


def encode_step_answer(
    argv: Sequence[str], host_paths: Sequence[str], env: dict[int, dict[str, str]]
) -> bytes:
    tokens = [TOK_ARGV, str(len(argv)), *argv]
    for src in host_paths:
        tokens += [TOK_SRC, src]
    for local, names in sorted(env.items()):
        for name, value in sorted(names.items()):
            tokens += [TOK_ENV, str(local), name, value]
    return ("\0".join(tokens) + "\0").encode("utf-8", "surrogateescape")


@dataclass(frozen=True)
class StepAnswer:
    argv: list[str]
    host_paths: list[str]
    env: dict[int, dict[str, str]]


def decode_step_answer(data: bytes) -> StepAnswer:
    """What spank/node.c's parse_answer takes from the answer, as strictly."""
    if not data.endswith(b"\0"):
        raise RequestError("step-prepare answer: not NUL-terminated")
    tok = data[:-1].decode("utf-8", "surrogateescape").split("\0")
    if len(tok) < 2 or tok[0] != TOK_ARGV or not tok[1].isdigit():
        raise RequestError("step-prepare answer: no argv")
    n = int(tok[1])
    argv = tok[2 : 2 + n]
    if not 1 <= n <= 256 or len(argv) != n or not argv[0].startswith("/"):
        raise RequestError("step-prepare answer: a bad argv")
    host_paths: list[str] = []
    env: dict[int, dict[str, str]] = {}
    i = 2 + n
    while i < len(tok):
        if tok[i] == TOK_SRC and i + 1 < len(tok):
            host_paths.append(tok[i + 1])
            i += 2
        elif tok[i] == TOK_ENV and i + 3 < len(tok) and tok[i + 1].isdigit():
            env.setdefault(int(tok[i + 1]), {})[tok[i + 2]] = tok[i + 3]
            i += 4
        else:
            raise RequestError(f"step-prepare answer: unexpected token {tok[i][:40]!r}")
    return StepAnswer(argv, host_paths, env)


# -- 4. submit-check -------------------------------------------------------------------


@dataclass(frozen=True)
class SubmitCheck:
    ref: str
    tf_mount: str
    job_image: str


MAX_FIELD = 4096


def decode_submit_check(args: Sequence[str]) -> SubmitCheck:
    """The one shape (4), field by field; anything else is refused."""
    a = list(args)
    if (
        len(a) != 5
        or a[0] != SUBMIT_CHECK
        or not a[1].startswith("--tf-mount=")
        or not a[2].startswith("--job-image=")
        or a[3] != "--"
    ):
        raise RequestError("pin server: malformed request")
    req = SubmitCheck(ref=a[4], tf_mount=a[1].partition("=")[2], job_image=a[2].partition("=")[2])
    for value in (req.ref, req.tf_mount, req.job_image):
        if len(value) > MAX_FIELD or "\0" in value:
            raise RequestError("pin server: malformed request")
    if not req.ref:
        raise RequestError("pin server: malformed request")
    return req


def encode_submit_check(req: SubmitCheck) -> list[str]:
    return [
        SUBMIT_CHECK,
        f"--tf-mount={req.tf_mount}",
        f"--job-image={req.job_image}",
        "--",
        req.ref,
    ]
