/* Submit side (srun, sbatch, salloc): check the reference and mounts and pin the
 * tag to its digest before anything is queued, then hand the pinned reference to
 * the job through its control environment (the prolog sees SPANK_TFIMAGE_IMAGE,
 * the job's steps SLURM_SPANK_TFIMAGE_IMAGE).
 *
 * The host's tfimage daemon answers first when it runs (its resolver socket, a
 * few ms); anything but a pinned reference or a rejected input from it, and the
 * helper pins as the user, as it would with no daemon (agent/resolver.py). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tfimage.h"

/* The helper already prefixes its messages; don't say it twice. */
const char *tfi_strip_prefix(const char *msg)
{
	return strncmp(msg, "tfimage: ", 9) == 0 ? msg + 9 : msg;
}

/* Ask the daemon's resolver: 0 pinned (out set), 2 input rejected (err set),
 * anything else: pin with the helper.  Half the submit deadline at most, so the
 * helper still has the other half. */
static int ask_resolver(char **out, size_t *len, char *err, size_t errlen)
{
	const char *job = getenv("SLURM_SPANK_TFIMAGE_IMAGE"); /* an srun inside a job */
	char *argv[] = { "tfimage", "submit-check", "--mounts", tfi_state.mounts, "--job-image",
			 (char *)(job ? job : ""), "--", tfi_state.image, NULL };
	int timeout = tfi_conf.submit_timeout > 1 ? tfi_conf.submit_timeout / 2 : 1;
	int rc;

	if (!tfi_conf.resolver[0])
		return -2;
	rc = tfi_daemon_call(tfi_conf.resolver, argv, timeout, out, len, err, errlen);
	if (rc == 0 || rc == 2)
		return rc;
	if (rc != -2)
		slurm_verbose("tfimage: submit: the resolver did not pin (%s); pinning here",
			      err[0] ? tfi_strip_prefix(err) : "no answer");
	free(*out);
	*out = NULL;
	*len = 0;
	err[0] = '\0';
	return -2;
}

int tfi_submit_init_post_opt(spank_t sp)
{
	/* --mounts=VALUE: a value starting with '-' stays a value. */
	char mounts[sizeof(tfi_state.mounts) + 16];
	char *argv[] = { tfi_conf.helper, "--config", tfi_conf.config, "submit-check",
			 mounts, "--", tfi_state.image, NULL };
	char err[512];
	char *out = NULL;
	size_t len = 0;
	long long start = tfi_now_ms();
	int rc;

	snprintf(mounts, sizeof(mounts), "--mounts=%s", tfi_state.mounts);
	rc = ask_resolver(&out, &len, err, sizeof(err));
	if (rc == -2) {
		long long left = tfi_conf.submit_timeout - (tfi_now_ms() - start) / 1000;

		rc = tfi_run_helper(argv, left > 1 ? (int)left : 1, &out, &len, err, sizeof(err));
	}
	if (rc != 0) {
		slurm_error("tfimage: submit: %s", err[0] ? tfi_strip_prefix(err)
							: "the image and mount check failed");
		free(out);
		return -1;
	}
	while (len > 0 && (out[len - 1] == '\n' || out[len - 1] == '\0'))
		len--;
	if (len == 0 || len > TFI_MAX_REF || memchr(out, '\n', len) || memchr(out, '\0', len)) {
		slurm_error("tfimage: submit: the helper gave no usable reference");
		free(out);
		return -1;
	}
	out[len] = '\0';
	if (err[0]) /* e.g. the registry was down and a remembered digest was used */
		slurm_info("%s", tfi_strip_prefix(err));
	slurm_verbose("tfimage: submit: %s pinned to %s", tfi_state.image, out);
	rc = spank_job_control_setenv(sp, "TFIMAGE_IMAGE", out, 1);
	free(out);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("tfimage: submit: cannot pass the image to the job: %s",
			    spank_strerror(rc));
		return -1;
	}
	return 0;
}
