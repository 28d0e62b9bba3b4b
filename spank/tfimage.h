/*
 * spank_tfimage: run each task of a --tf-image job inside its SIF image.
 *
 * tfimage.c routes every SPANK callback to the file for its context:
 *   submit.c  srun/sbatch/salloc: check the reference, hand it to the job
 *   node.c    slurmstepd: ready the image (root), then wrap each task
 *   spawn.c   running the tfimage helper with a deadline, output kept for errors
 *   client.c  the same request to the host's warm tfimage daemon, when one runs
 *   wire.h    the constants of agent/core/wire.py, which describes every message
 *   args.c    plugstack.conf arguments
 * Every message starts with "tfimage:" and names the phase and the cause.
 */
#ifndef TFIMAGE_H
#define TFIMAGE_H

#include <stddef.h>
#include <stdint.h>
#include <slurm/spank.h>

#include "wire.h"

#define TFI_MAX_REF 512
#define TFI_MAX_PATH 4096
#define TFI_MAX_ARGS 256
#define TFI_MAX_ENV 1024

enum tfi_batch { TFI_BATCH_AUTO = 0, TFI_BATCH_CONTAINER, TFI_BATCH_HOST };

struct tfi_conf {
	char helper[TFI_MAX_PATH];   /* the tfimage command */
	char config[TFI_MAX_PATH];   /* site config passed to it */
	int submit_timeout;          /* seconds for the submit-side check */
	int prepare_timeout;         /* seconds for the node-side prepare */
	char daemon[TFI_MAX_PATH];   /* tfimage daemon's socket ("" = always exec) */
	char pin_socket[TFI_MAX_PATH]; /* its pin server for users ("" = always exec) */
	char state_dir[TFI_MAX_PATH]; /* where the prolog leaves a job's default image
				       * ("" = a job without --tf-image runs on the host) */
};

struct tfi_state {
	int image_set;
	char image[TFI_MAX_REF + 1];
	char binds[TFI_MAX_PATH];   /* --tf-mount (binds), checked by the helper */
	enum tfi_batch batch;
	int batch_set;              /* --tf-batch was given */
	/* node side: the helper's answer, NUL-separated tokens (see node.c) */
	char *prefix_buf;
	char *prefix[TFI_MAX_ARGS + 1];
	int prefix_len;
	char *env[3 * TFI_MAX_ENV]; /* (local task id, name, value) triples */
	int env_len;
	char *host_paths[TFI_MAX_ARGS]; /* --tf-mount host paths each task checks as the user */
	int host_paths_len;
	/* node side: why the image could not be readied; reported by each task,
	 * whose stderr the user sees (slurmstepd's own log reaches only the admin) */
	char error[600];
	/* node side: what the helper was asked, to ask again from a task whose
	 * real working directory (known only there) differs from $PWD */
	unsigned job_id, step_id, uid, node_id, local_tasks;
	uint32_t array_job, array_task; /* 0: not a job array's task */
	char **job_env;
	char workdir[TFI_MAX_PATH];
	char script[TFI_MAX_PATH];
};

extern struct tfi_conf tfi_conf;
extern struct tfi_state tfi_state;

/* args.c */
int tfi_parse_args(int ac, char **av);

/* spawn.c: run argv (no shell) with a deadline; stdout kept in *out
 * (malloc'ed, caller frees).  Returns the exit status, TFI_SPAWN_TIMEOUT when
 * it did not finish in time, or -1 when it could not start; errbuf gets the
 * child's last stderr line. */
#define TFI_SPAWN_TIMEOUT (-3)
int tfi_spawn(char *const argv[], int timeout_s, char **out, size_t *out_len,
		   char *errbuf, size_t errlen);

/* spawn.c also: a monotonic clock in ms, and the last non-empty line of buf
 * (what explains a failure), cut to fit dst */
long long tfi_now_ms(void);
void tfi_last_line(const char *buf, size_t len, char *dst, size_t dstlen);

/* client.c: the same request to the host's tfimage daemon (argv[1..], the
 * helper's arguments), same results; -2 when no daemon answers, so the caller
 * runs the helper itself.  Root-side callers use its root-only socket, the
 * submit side its pin socket. */
int tfi_ask_daemon(const char *sock, char *const argv[], int timeout_s, char **out,
		    size_t *out_len, char *errbuf, size_t errlen);

/* submit.c */
int tfi_submit_init_post_opt(spank_t sp);

/* submit.c also: strip the helper's own "tfimage: " prefix */
const char *tfi_strip_prefix(const char *msg);

/* node.c */
int tfi_node_init_post_opt(spank_t sp);
int tfi_node_default_image(spank_t sp);
int tfi_node_task_init_privileged(spank_t sp);
int tfi_node_task_init(spank_t sp);
void tfi_node_exit(spank_t sp);

#endif
