# Sourced by the scripts that need the other Debian generation (and its Slurm):
# sets CACHE, MIRROR and OTHER, the codename that is not this machine's.
CACHE=${TFIMAGE_BUILD_CACHE:-/var/cache/tfimage-build}
MIRROR=${TFIMAGE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
case "$(. /etc/os-release && echo "$VERSION_CODENAME")" in
    bookworm) OTHER=trixie ;;   # Slurm 22.05 here, 24.11 there
    trixie) OTHER=bookworm ;;   # and the other way round
    *) echo "tfimage: this is neither Debian 12 nor 13; set TFIMAGE_OTHER_RELEASE" >&2
       OTHER=${TFIMAGE_OTHER_RELEASE:?} ;;
esac
