/* Dispatch: each SPANK callback to its context's file.  See tfimage.h. */
#include <stdlib.h>
#include <string.h>

#include "tfimage.h"

SPANK_PLUGIN(tfimage, 1);

struct tfi_conf tfi_conf;
struct tfi_state tfi_state;

static int opt_image(int val, const char *optarg, int remote);
static int opt_batch(int val, const char *optarg, int remote);
static int opt_bind(int val, const char *optarg, int remote);

static struct spank_option tfi_options[] = {
	{ "tf-image", "REF",
	  "[tfimage] run the job's tasks inside this SIF image "
	  "(name:tag, project/name:tag, host/path:tag, @sha256:..., oras:// or docker://)",
	  1, 0, opt_image },
	{ "tf-mount", "SRC:DST[:ro|rw][,...]",
	  "[tfimage] bind host directories into the image (host paths limited to the site's "
	  "allowed prefixes)",
	  1, 0, opt_bind },
	{ "tf-batch", "auto|container|host",
	  "[tfimage] where the batch script runs: auto (in the image if the job has one "
	  "task, else on the host so srun works), container or host",
	  1, 0, opt_batch },
	SPANK_OPTIONS_TABLE_END
};

/* Whether s holds a control character: such a value would forge lines in the
 * logs that quote it (slurmd's, slurmstepd's). */
static int has_control(const char *s)
{
	for (; *s; s++)
		if ((unsigned char)*s < 0x20 || *s == 0x7f)
			return 1;
	return 0;
}

static int opt_image(int val, const char *optarg, int remote)
{
	(void)val;
	(void)remote;
	if (optarg == NULL || optarg[0] == '\0') {
		slurm_error("tfimage: --tf-image: an image reference is required");
		return -1;
	}
	if (strlen(optarg) > TFI_MAX_REF) {
		slurm_error("tfimage: --tf-image: reference longer than %d characters", TFI_MAX_REF);
		return -1;
	}
	if (has_control(optarg)) {
		slurm_error("tfimage: --tf-image: the reference holds a control character");
		return -1;
	}
	strcpy(tfi_state.image, optarg);
	tfi_state.image_set = 1;
	return 0;
}

static int opt_bind(int val, const char *optarg, int remote)
{
	(void)val;
	(void)remote;
	if (optarg == NULL || strlen(optarg) >= sizeof(tfi_state.binds)) {
		slurm_error("tfimage: --tf-mount: missing or longer than %zu characters",
			    sizeof(tfi_state.binds) - 1);
		return -1;
	}
	if (has_control(optarg)) {
		slurm_error("tfimage: --tf-mount: the value holds a control character");
		return -1;
	}
	strcpy(tfi_state.binds, optarg);
	return 0;
}

static int opt_batch(int val, const char *optarg, int remote)
{
	(void)val;
	(void)remote;
	if (optarg && strcmp(optarg, "auto") == 0)
		tfi_state.batch = TFI_BATCH_AUTO;
	else if (optarg && strcmp(optarg, "container") == 0)
		tfi_state.batch = TFI_BATCH_CONTAINER;
	else if (optarg && strcmp(optarg, "host") == 0)
		tfi_state.batch = TFI_BATCH_HOST;
	else {
		slurm_error("tfimage: --tf-batch: '%s' is not one of auto, container, host",
			    optarg ? optarg : "");
		return -1;
	}
	tfi_state.batch_set = 1;
	return 0;
}

/* --tf-mount or --tf-batch given at submit without an image to apply to: said once,
 * not ignored in silence.  Inside a job (its image inherited) they do apply. */
static void warn_unused(void)
{
	spank_context_t ctx = spank_context();

	if ((ctx != S_CTX_LOCAL && ctx != S_CTX_ALLOCATOR) || getenv(TFI_STEP_IMAGE_VAR))
		return;
	if (tfi_state.binds[0] || tfi_state.batch_set)
		slurm_info("tfimage: %s%s%s: no effect without --tf-image; add --tf-image=NAME:TAG",
			   tfi_state.binds[0] ? "--tf-mount" : "",
			   tfi_state.binds[0] && tfi_state.batch_set ? " and " : "",
			   tfi_state.batch_set ? "--tf-batch" : "");
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();

	if (ctx != S_CTX_LOCAL && ctx != S_CTX_ALLOCATOR && ctx != S_CTX_REMOTE)
		return 0;
	if (tfi_parse_args(ac, av) != 0)
		return -1;
	/* Registered here, not through a static table: sbatch 22.05 only sees
	 * options registered from slurm_spank_init. */
	for (struct spank_option *o = tfi_options; o->name; o++) {
		if (spank_option_register(sp, o) != ESPANK_SUCCESS) {
			slurm_error("tfimage: init: cannot register --%s", o->name);
			return -1;
		}
	}
	return 0;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (!tfi_state.image_set &&
	    !(spank_context() == S_CTX_REMOTE && tfi_node_default_image(sp))) {
		warn_unused();
		return 0; /* a job without --tf-image sees no change at all */
	}
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
		return tfi_submit_init_post_opt(sp);
	case S_CTX_REMOTE:
		return tfi_node_init_post_opt(sp);
	default:
		return 0;
	}
}

int slurm_spank_task_init_privileged(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (!tfi_state.image_set || spank_context() != S_CTX_REMOTE)
		return 0;
	return tfi_node_task_init_privileged(sp);
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (!tfi_state.image_set || spank_context() != S_CTX_REMOTE)
		return 0;
	return tfi_node_task_init(sp);
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() == S_CTX_REMOTE)
		tfi_node_exit(sp);
	return 0;
}
