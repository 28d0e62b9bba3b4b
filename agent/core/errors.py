"""Every exception tfimage raises on purpose, in one place.

    TfimageError                 base; ``str(e)`` is a one-line message for a person
    +-- ConfigError              bad or unreadable config file              (exit 2)
    +-- CredentialsError         credentials file unsafe or malformed       (exit 2)
    +-- InputError               a user's input is wrong: final, whoever    (exit 2)
    |   |                        checks it (the pin server answers 2, the
    |   |                        plugin rejects the submission)
    |   +-- ImageReferenceError  malformed or disallowed image reference
    |   +-- BindError            a bad --tf-mount (or an admin's default bind)
    |   +-- StepLayoutError      a step's Slurm variables missing, inconsistent
    |   |                        or larger than step_max_tasks
    |   +-- PolicyError          not an image the job's partition runs (the
    |                            config's partitions: rules)
    +-- RequestError             a daemon request not of its one shape      (exit 1)
    +-- ImageError               the image can't be had; never drains a node (exit 3)
    |   +-- RegistryError        auth refused, not found, bad answer
    |   |   +-- ImageNotFound        no such tag or repository (for these credentials)
    |   |   +-- RegistryUnreachable  no answer (connection, timeout, 5xx) after retries
    |   |   |   +-- RegistryStalled  no byte within the read timeout: not asked again
    |   |   +-- RangeUnsupported     Range answered with the whole blob (caller streams it)
    |   +-- VerificationError    size, digest, media type or SIF magic wrong
    |   +-- CacheError           the node cache can't store or publish it
    |   +-- UnsafeImage          a link (or a non-directory) where tfimage must
    |   |                        write into an unpacked image
    |   +-- DeadlineExceeded     not ready within the config's hook_deadline
    |   +-- AccessDenied         the job's user may not run images of that
    |                            repository (the config's access: rules)
    +-- RuntimeSetupError        mounting or preparing the runtime failed   (exit 3)
    +-- NodeFault                the node's own hardware is faulty (a GPU)  (exit 1)

Anything else escaping is a bug; the CLI prints it as one line with exit 70, and
:func:`cause` is what a hook or the daemon logs for any exception.  The
node hooks (hooks/log.py's guarded) exit 0 for every exception but ``NodeFault``: only a
fault of the node may drain it.
"""

from __future__ import annotations


class TfimageError(Exception):
    """Base class.  ``exit_code`` is what the CLI exits with."""

    exit_code = 1


class ConfigError(TfimageError):
    exit_code = 2


class CredentialsError(TfimageError):
    exit_code = 2


class InputError(TfimageError):
    exit_code = 2


class ImageReferenceError(InputError):
    pass


class BindError(InputError):
    pass


class StepLayoutError(InputError):
    pass


class PolicyError(InputError):
    pass


class RequestError(TfimageError):
    pass


class ImageError(TfimageError):
    exit_code = 3


class RegistryError(ImageError):
    pass


class ImageNotFound(RegistryError):  # noqa: N818 - it names a state, like FileNotFoundError
    pass


class RegistryUnreachable(RegistryError):  # noqa: N818 - it names a state, like ConnectionRefused
    pass


class RegistryStalled(RegistryUnreachable):
    """It stopped answering for a whole read timeout: asking again would cost as much
    again, so the pull ends at once and the user learns why within one timeout (a
    mirror is still tried)."""


class RangeUnsupported(RegistryError):  # noqa: N818 - it names a state
    pass


class VerificationError(ImageError):
    pass


class CacheError(ImageError):
    pass


class UnsafeImage(ImageError):  # noqa: N818 - it names what the image is
    pass


class DeadlineExceeded(ImageError):  # noqa: N818 - it names what happened
    pass


class AccessDenied(ImageError):  # noqa: N818 - it names what happened
    pass


class RuntimeSetupError(TfimageError):
    exit_code = 3


class NodeFault(TfimageError):  # noqa: N818 - it names what the node has
    """A fault of the node itself: the one reason a hook exits non-zero (Slurm then
    drains the node and requeues the job)."""

    exit_code = 1


def cause(e: BaseException) -> str:
    """One line for a person: a TfimageError's own message, anything else's type too."""
    return str(e) if isinstance(e, TfimageError) else f"{type(e).__name__}: {e}"
