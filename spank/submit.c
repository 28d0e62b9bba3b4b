/* Submit side (srun, sbatch, salloc): check the reference and mounts and pin the
 * tag to its digest before anything is queued, then hand the pinned reference to
 * the job through its control environment (the prolog sees SPANK_TFIMAGE_IMAGE,
 * the job's steps SLURM_SPANK_TFIMAGE_IMAGE). */
#include <stdlib.h>
#include <string.h>

#include "tfimage.h"

/* The helper already prefixes its messages; don't say it twice. */
const char *tfi_strip_prefix(const char *msg)
{
	return strncmp(msg, "tfimage: ", 9) == 0 ? msg + 9 : msg;
}

int tfi_submit_init_post_opt(spank_t sp)
{
	char *argv[] = { tfi_conf.helper, "--config", tfi_conf.config, "submit-check",
			 "--mounts", tfi_state.mounts, "--", tfi_state.image, NULL };
	char err[512];
	char *out = NULL;
	size_t len = 0;
	int rc;

	rc = tfi_run_helper(argv, tfi_conf.submit_timeout, &out, &len, err, sizeof(err));
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
