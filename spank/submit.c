/* Submit side (srun, sbatch, salloc): check the reference and --tf-mount and pin
 * the tag to its digest before anything is queued, then hand the pinned reference
 * to the job through its control environment (the prolog sees SPANK_TFIMAGE_IMAGE,
 * the job's steps SLURM_SPANK_TFIMAGE_IMAGE).
 *
 * The host's pin server (the daemon's pin socket) answers first when it runs, a
 * few ms; anything but a pinned reference or a rejected input from it, and the
 * helper pins as the user, as it would with no daemon.  Both get the same
 * submit-check request (agent/core/wire.py, 4). */
#define _GNU_SOURCE
#include <ctype.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tfimage.h"

/* The helper already prefixes its messages; don't say it twice. */
const char *tfi_strip_prefix(const char *msg)
{
	return strncmp(msg, "tfimage: ", 9) == 0 ? msg + 9 : msg;
}

/* Ask the pin server: 0 pinned (out set), 2 input rejected (err set), anything
 * else: pin with the helper.  Half the submit deadline at most, so the helper
 * still has the other half.  argv is the helper's (argv[1..] is sent).  Why a
 * running pin server did not pin goes to why: when the helper fails too, the
 * user's own view (no credentials for a private project, say) is not the cause.
 * A busy server (its slots taken: one user's flood, this user's own burst of
 * submissions) is asked again, backing off from 100 ms to 1 s with jitter, while
 * that half lasts: the helper pins with the user's own credentials, which a
 * private project's image does not take (the soak: 20 of 2,000 refused so). */
static int ask_pin_server(char *const argv[], char **out, size_t *len, char *err,
			  size_t errlen, char *why, size_t whylen)
{
	int timeout = tfi_conf.submit_timeout > 1 ? tfi_conf.submit_timeout / 2 : 1;
	long long until = tfi_now_ms() + (long long)timeout * 1000;
	long long pause = 100;
	/* its own generator: the host program's random() is not the plugin's to seed */
	unsigned int seed = (unsigned int)getpid() ^ (unsigned int)until;
	int rc;

	if (!tfi_conf.pin_socket[0])
		return -2;
	for (;;) {
		long long left = (until - tfi_now_ms() + 999) / 1000;
		long long nap = pause / 2 + (long long)(rand_r(&seed) % (pause + 1));

		rc = tfi_ask_daemon(tfi_conf.pin_socket, argv, left > 1 ? (int)left : 1, out,
				    len, err, errlen);
		if (rc != TFI_PIN_BUSY || tfi_now_ms() + nap + 1000 > until)
			break;
		free(*out);
		*out = NULL;
		*len = 0;
		usleep((useconds_t)(nap * 1000));
		pause = pause * 2 > 1000 ? 1000 : pause * 2;
	}
	if (rc == 0 || rc == 2)
		return rc;
	if (rc != -2) {
		snprintf(why, whylen, "%s", err[0] ? tfi_strip_prefix(err) : "no answer");
		slurm_verbose("tfimage: submit: the pin server did not pin (%s); pinning here",
			      why);
	}
	free(*out);
	*out = NULL;
	*len = 0;
	err[0] = '\0';
	return -2;
}

/* The admin's kill switch (wire.h's TFI_OFF_SWITCH beside the config): 1 and
 * its first line in why (printable bytes only) when it is there, else 0. */
static int switched_off(char *why, size_t n)
{
	char dir[TFI_MAX_PATH], path[TFI_MAX_PATH + sizeof(TFI_OFF_SWITCH) + 1];
	FILE *f;
	size_t i = 0;
	int c;

	strcpy(dir, tfi_conf.config);
	snprintf(path, sizeof(path), "%s/%s", dirname(dir), TFI_OFF_SWITCH);
	f = fopen(path, "re");
	if (!f)
		return 0;
	while (i + 1 < n && (c = fgetc(f)) != EOF && c != '\n')
		if (isprint(c))
			why[i++] = (char)c;
	why[i] = '\0';
	fclose(f);
	return 1;
}

int tfi_submit_init_post_opt(spank_t sp)
{
	const char *job = getenv(TFI_STEP_IMAGE_VAR); /* an srun inside a job */
	char *binds = NULL, *job_image = NULL, *out = NULL;
	char err[512], host_why[512] = "";
	size_t len = 0;
	long long start = tfi_now_ms();
	int rc;

	if (!job && switched_off(err, 200)) {
		slurm_error("tfimage: submit: --tf-image is turned off on this cluster%s%s; "
			    "jobs already queued still run",
			    err[0] ? ": " : "", err);
		return -1;
	}
	if (asprintf(&binds, "%s%s", TFI_ARG_TF_MOUNT, tfi_state.binds) < 0 ||
	    asprintf(&job_image, "%s%s", TFI_ARG_JOB_IMAGE, job ? job : "") < 0) {
		slurm_error("tfimage: submit: out of memory");
		return -1;
	}
	{
		/* the helper's argv; the pin server gets argv[3..], the same request */
		char *argv[] = { tfi_conf.helper, "--config", tfi_conf.config,
				 TFI_CMD_SUBMIT_CHECK, binds, job_image, "--", tfi_state.image, NULL };

		rc = ask_pin_server(&argv[2], &out, &len, err, sizeof(err), host_why,
				    sizeof(host_why));
		if (rc == -2) {
			long long left = tfi_conf.submit_timeout - (tfi_now_ms() - start) / 1000;

			rc = tfi_spawn(argv, left > 1 ? (int)left : 1, &out, &len, err, sizeof(err));
		}
	}
	free(binds);
	free(job_image);
	if (rc == TFI_SPAWN_TIMEOUT) {
		/* What the user can do, not which program was slow (its path helps no one). */
		slurm_error("tfimage: submit: %s: no answer within submit_timeout (%d s): the "
			    "registry may be down or overloaded; try again later, or name the image "
			    "by digest (NAME@sha256:...), which a later srun inside the job reuses",
			    tfi_state.image, tfi_conf.submit_timeout);
		free(out);
		return -1;
	}
	if (rc != 0) {
		const char *own = err[0] ? tfi_strip_prefix(err)
					 : "the image and --tf-mount check failed";

		/* The host's reason first: the registry down, not the user's credentials;
		 * once where both said the same (a repository neither may read). */
		if (host_why[0] && rc != 2 && strcmp(host_why, own) != 0)
			slurm_error("tfimage: submit: %s; pinning with your own credentials: %s",
				    host_why, own);
		else
			slurm_error("tfimage: submit: %s", own);
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
	rc = spank_job_control_setenv(sp, TFI_CONTROL_IMAGE, out, 1);
	free(out);
	if (rc != ESPANK_SUCCESS) {
		slurm_error("tfimage: submit: cannot pass the image to the job: %s",
			    spank_strerror(rc));
		return -1;
	}
	return 0;
}
