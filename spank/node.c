/* Node side (slurmstepd).  init_post_opt runs as root once per step: the helper
 * makes the image ready and prints the argv prefix that runs a task inside it.
 * task_init runs as the user in each task and puts that prefix in front of the
 * task's command: spank_prepend_task_argv on Slurm >= 23.11, exec on older. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <slurm/slurm.h>

#include "tfimage.h"



#if SLURM_VERSION_NUMBER >= SLURM_VERSION_NUM(23, 11, 0)
#define TFI_HAVE_PREPEND 1
#else
#define TFI_HAVE_PREPEND 0
#endif

static const char *env_get(char **env, const char *name)
{
	size_t n = strlen(name);

	for (; env && *env; env++)
		if (strncmp(*env, name, n) == 0 && (*env)[n] == '=')
			return *env + n + 1;
	return NULL;
}

/* The job's task count, for --tf-batch=auto: SLURM_NTASKS when given, else one
 * task per node. */
static long job_tasks(char **env)
{
	const char *v = env_get(env, "SLURM_NTASKS");

	if (!v)
		v = env_get(env, "SLURM_JOB_NUM_NODES");
	return v ? strtol(v, NULL, 10) : 1;
}

static int batch_in_container(char **env)
{
	switch (tfi_state.batch) {
	case TFI_BATCH_CONTAINER:
		return 1;
	case TFI_BATCH_HOST:
		return 0;
	default:
		return job_tasks(env) <= 1;
	}
}

/* Whether Slurm allocated GPUs to the step (its gres plugins set these).  A
 * gres/shard step gets GPU_DEVICE_ORDINAL and SLURM_SHARDS_ON_NODE alone (seen on
 * 22.05.8): no CUDA_VISIBLE_DEVICES, yet it needs the driver as much. */
static int step_has_gpus(char **env)
{
	static const char *const names[] = { "SLURM_STEP_GPUS", "SLURM_JOB_GPUS",
					     "CUDA_VISIBLE_DEVICES", "SLURM_SHARDS_ON_NODE",
					     NULL };

	for (int i = 0; names[i]; i++) {
		const char *v = env_get(env, names[i]);

		if (v && v[0] && strcmp(v, "NoDevFiles") != 0)
			return 1;
	}
	return 0;
}

/* The helper's answer, agent/core/wire.py (3): NUL-separated tokens
 *   argv N a1 .. aN        the runtime's prefix
 *   src PATH               a --tf-mount host path each task checks, as the user
 *   env L NAME VALUE       set NAME=VALUE in local task L unless the user did */
static int parse_answer(char *buf, size_t len)
{
	char *tok[3 * TFI_MAX_ENV + TFI_MAX_ARGS + 8];
	int n = 0, i = 0;
	size_t pos = 0;

	while (pos < len) {
		size_t l = strnlen(buf + pos, len - pos);

		if (pos + l >= len || n >= (int)(sizeof(tok) / sizeof(tok[0])))
			return -1;
		tok[n++] = buf + pos;
		pos += l + 1;
	}
	if (n < 2 || strcmp(tok[0], TFI_TOK_ARGV) != 0)
		return -1;
	tfi_state.prefix_len = atoi(tok[1]);
	if (tfi_state.prefix_len < 1 || tfi_state.prefix_len > TFI_MAX_ARGS ||
	    tfi_state.prefix_len + 2 > n)
		return -1;
	for (i = 0; i < tfi_state.prefix_len; i++)
		tfi_state.prefix[i] = tok[2 + i];
	tfi_state.prefix[i] = NULL;
	if (tfi_state.prefix[0][0] != '/')
		return -1;
	tfi_state.env_len = 0;
	tfi_state.host_paths_len = 0;
	for (i = 2 + tfi_state.prefix_len; i < n;) {
		if (strcmp(tok[i], TFI_TOK_SRC) == 0 && i + 1 < n && tfi_state.host_paths_len < TFI_MAX_ARGS) {
			tfi_state.host_paths[tfi_state.host_paths_len++] = tok[i + 1];
			i += 2;
		} else if (strcmp(tok[i], TFI_TOK_ENV) == 0 && i + 3 < n && tfi_state.env_len < TFI_MAX_ENV) {
			tfi_state.env[3 * tfi_state.env_len] = tok[i + 1];
			tfi_state.env[3 * tfi_state.env_len + 1] = tok[i + 2];
			tfi_state.env[3 * tfi_state.env_len + 2] = tok[i + 3];
			tfi_state.env_len++;
			i += 4;
		} else {
			return -1;
		}
	}
	return 0;
}

/* Ask the helper (as root) to ready the image for this step; on success the
 * argv prefix replaces any earlier one, on failure the reason is kept for the
 * tasks to report. */
static int prepare(void)
{
	static const char *const layout[] = TFI_LAYOUTS;
	char err[512];
	/* 4 fixed words, 6 ids, workdir, script, binds, --gpus, 2 array ids, a
	 * --layout per TFI_LAYOUTS entry (9), NULL: 26; room to spare. */
	char *hargv[48], *out = NULL, *own[32] = { NULL };
	size_t len = 0;
	int h = 0, o = 0, rc = -1;

	/* agent/core/wire.py (2): every value as --name=VALUE, a value is the job's, and
	 * one starting with '-' must stay a value. */
	hargv[h++] = tfi_conf.helper;
	hargv[h++] = "--config";
	hargv[h++] = tfi_conf.config;
	hargv[h++] = TFI_CMD_STEP_PREPARE;
	if (asprintf(&own[o++], "%s%u", TFI_ARG_JOB, tfi_state.job_id) < 0 ||
	    asprintf(&own[o++], "%s%u", TFI_ARG_STEP, tfi_state.step_id) < 0 ||
	    asprintf(&own[o++], "%s%u", TFI_ARG_UID, tfi_state.uid) < 0 ||
	    asprintf(&own[o++], "%s%s", TFI_ARG_IMAGE, tfi_state.image) < 0 ||
	    asprintf(&own[o++], "%s%u", TFI_ARG_NODE_ID, tfi_state.node_id) < 0 ||
	    asprintf(&own[o++], "%s%u", TFI_ARG_LOCAL_TASKS, tfi_state.local_tasks) < 0) {
		own[o - 1] = NULL;
		snprintf(err, sizeof(err), "out of memory");
		goto failed;
	}
	for (int i = 0; i < o; i++)
		hargv[h++] = own[i];
	if (tfi_state.workdir[0]) {
		if (asprintf(&own[o], "%s%s", TFI_ARG_WORKDIR, tfi_state.workdir) < 0)
			goto oom;
		hargv[h++] = own[o++];
	}
	if (tfi_state.script[0]) {
		if (asprintf(&own[o], "%s%s", TFI_ARG_SCRIPT, tfi_state.script) < 0)
			goto oom;
		hargv[h++] = own[o++];
	}
	if (tfi_state.binds[0]) {
		if (asprintf(&own[o], "%s%s", TFI_ARG_TF_MOUNT, tfi_state.binds) < 0)
			goto oom;
		hargv[h++] = own[o++];
	}
	if (step_has_gpus(tfi_state.job_env))
		hargv[h++] = TFI_ARG_GPUS;
	if (tfi_state.array_job) {
		if (asprintf(&own[o], "%s%u", TFI_ARG_ARRAY_JOB, tfi_state.array_job) < 0)
			goto oom;
		hargv[h++] = own[o++];
		if (asprintf(&own[o], "%s%u", TFI_ARG_ARRAY_TASK, tfi_state.array_task) < 0)
			goto oom;
		hargv[h++] = own[o++];
	}
	/* The step's layout, for TF_CONFIG: the helper parses it strictly. */
	for (int i = 0; layout[i]; i++) {
		const char *v = env_get(tfi_state.job_env, layout[i]);

		if (!v)
			continue;
		if (asprintf(&own[o], "%s%s=%s", TFI_ARG_LAYOUT, layout[i], v) < 0)
			goto oom;
		hargv[h++] = own[o++];
	}
	hargv[h] = NULL;

	/* The node's warm daemon when one runs (no Python start per step), else the helper. */
	rc = tfi_ask_daemon(tfi_conf.daemon, hargv, tfi_conf.prepare_timeout, &out, &len, err,
			     sizeof(err));
	if (rc == -2)
		rc = tfi_spawn(hargv, tfi_conf.prepare_timeout, &out, &len, err, sizeof(err));
	if (rc == 0 && parse_answer(out, len) == 0) {
		for (int i = 0; i < o; i++)
			free(own[i]);
		free(tfi_state.prefix_buf);
		tfi_state.prefix_buf = out;
		tfi_state.error[0] = '\0';
		return 0;
	}
	if (rc == 0)
		snprintf(err, sizeof(err), "the helper gave no usable command");
	else if (!err[0])
		snprintf(err, sizeof(err), "the helper failed");
	goto failed;
oom:
	snprintf(err, sizeof(err), "out of memory");
failed:
	for (int i = 0; i < o; i++)
		free(own[i]);
	snprintf(tfi_state.error, sizeof(tfi_state.error), "tfimage: prepare %s: %s",
		 tfi_state.image, tfi_strip_prefix(err));
	slurm_error("%s (job %u step %u)", tfi_state.error, tfi_state.job_id, tfi_state.step_id);
	free(out);
	return -1;
}

static void copy_path(char *dst, const char *src)
{
	if (src && src[0] == '/' && strlen(src) < TFI_MAX_PATH)
		strcpy(dst, src);
	else
		dst[0] = '\0';
}

/* A job that named no image, in a partition with a default one: the prolog left
 * the image's name in state_dir/jobs/<job>.default-image (layout.job_default_image),
 * root's, before it readied it.  Read as root, never through a link; anything but a
 * small root-owned file of printable text is not one.  1 when the job has one. */
int tfi_node_default_image(spank_t sp)
{
	uint32_t job_id = 0;
	char path[TFI_MAX_PATH + 48], buf[TFI_MAX_REF + 2];
	struct stat st;
	ssize_t n;
	int fd;

	if (!tfi_conf.state_dir[0] || spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS)
		return 0;
	if (snprintf(path, sizeof(path), "%s/jobs/%u.default-image", tfi_conf.state_dir,
		     job_id) >= (int)sizeof(path))
		return 0;
	fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0)
		return 0;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != 0 ||
	    st.st_size > (off_t)sizeof(buf) - 1) {
		close(fd);
		return 0;
	}
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = '\0';
	if (buf[n - 1] == '\n')
		buf[--n] = '\0';
	if (n == 0 || n > TFI_MAX_REF)
		return 0;
	for (ssize_t i = 0; i < n; i++)
		if ((unsigned char)buf[i] <= ' ' || buf[i] == 0x7f)
			return 0;
	strcpy(tfi_state.image, buf);
	tfi_state.image_set = 1;
	return 1;
}

int tfi_node_init_post_opt(spank_t sp)
{
	uint32_t job_id = 0, step_id = 0;
	uid_t uid = 0;
	char **env = NULL, **argv = NULL;
	int argc = 0;

	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_STEPID, &step_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_ENV, &env) != ESPANK_SUCCESS) {
		slurm_error("tfimage: prepare: cannot read the step's identity from Slurm");
		return -1;
	}
	if (step_id == SLURM_EXTERN_CONT || step_id == SLURM_INTERACTIVE_STEP ||
	    (step_id == SLURM_BATCH_SCRIPT && !batch_in_container(env))) {
		tfi_state.image_set = 0; /* this step runs on the host */
		return 0;
	}
	tfi_state.job_id = job_id;
	tfi_state.step_id = step_id;
	tfi_state.uid = (unsigned)uid;
	tfi_state.job_env = env;
	if (spank_get_item(sp, S_JOB_NODEID, &tfi_state.node_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_LOCAL_TASK_COUNT, &tfi_state.local_tasks) != ESPANK_SUCCESS) {
		slurm_error("tfimage: prepare: cannot read the step's layout from Slurm");
		return -1;
	}
	/* The array's ids, for the usage record: the batch step's alone, which slurmd
	 * has from slurmctld's launch message.  A launch step's are read from the
	 * step's environment (SLURM_ARRAY_*, 22.05.8: slurmstepd_job.c), which the
	 * user sets, and a plain job's say the job's own id and NO_VAL. */
	if (step_id != SLURM_BATCH_SCRIPT ||
	    spank_get_item(sp, S_JOB_ARRAY_ID, &tfi_state.array_job) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_ARRAY_TASK_ID, &tfi_state.array_task) != ESPANK_SUCCESS ||
	    tfi_state.array_task >= NO_VAL)
		tfi_state.array_job = tfi_state.array_task = 0;
	/* $PWD is the working directory in the common case; a task whose real one
	 * differs asks again from task_init_privileged. */
	copy_path(tfi_state.workdir, env_get(env, "PWD"));
	tfi_state.script[0] = '\0';
	if (step_id == SLURM_BATCH_SCRIPT &&
	    spank_get_item(sp, S_JOB_ARGV, &argc, &argv) == ESPANK_SUCCESS && argc > 0)
		copy_path(tfi_state.script, argv[0]);
	/* Not fatal here: the tasks report a failure, on the stderr the user reads. */
	prepare();
	return 0;
}

/* Root, in each task, whose working directory is now the step's real one. */
int tfi_node_task_init_privileged(spank_t sp)
{
	char cwd[TFI_MAX_PATH];

	(void)sp;
	if (tfi_state.error[0] || !getcwd(cwd, sizeof(cwd)) || cwd[0] != '/')
		return 0;
	if (strcmp(cwd, tfi_state.workdir) == 0)
		return 0;
	strcpy(tfi_state.workdir, cwd);
	prepare();
	return 0;
}

int tfi_node_task_init(spank_t sp)
{
	if (tfi_state.error[0]) {
		fprintf(stderr, "%s\n", tfi_state.error);
		fflush(stderr);
		return -1;
	}
	if (!tfi_state.prefix_buf)
		return 0;
	/* As the user: each host path was resolved as the user when the step was
	 * prepared, and is bound by that real path; it must still be that path (no
	 * link put in its way since), or nothing is bound. */
	for (int i = 0; i < tfi_state.host_paths_len; i++) {
		char real[PATH_MAX];

		if (!realpath(tfi_state.host_paths[i], real)) {
			fprintf(stderr, "tfimage: --tf-mount: host path %s: %s\n", tfi_state.host_paths[i],
				strerror(errno));
			fflush(stderr);
			return -1;
		}
		if (strcmp(real, tfi_state.host_paths[i]) != 0) {
			fprintf(stderr, "tfimage: --tf-mount: host path %s changed since the step was "
				"prepared; not bound\n", tfi_state.host_paths[i]);
			fflush(stderr);
			return -1;
		}
	}
	{
		int task = -1;
		char id[16];

		if (spank_get_item(sp, S_TASK_ID, &task) != ESPANK_SUCCESS) {
			slurm_error("tfimage: task: cannot read the local task id");
			return -1;
		}
		snprintf(id, sizeof(id), "%d", task);
		for (int i = 0; i < tfi_state.env_len; i++) {
			char **e = &tfi_state.env[3 * i];

			spank_err_t rc;

			if (strcmp(e[0], id) != 0)
				continue;
			/* overwrite=0: a variable the user set wins (ESPANK_ENV_EXISTS) */
			rc = spank_setenv(sp, e[1], e[2], 0);
			if (rc != ESPANK_SUCCESS && rc != ESPANK_ENV_EXISTS)
				slurm_error("tfimage: task: cannot set %s: %s", e[1], spank_strerror(rc));
		}
	}
#if TFI_HAVE_PREPEND
	if (spank_prepend_task_argv(sp, tfi_state.prefix_len,
				    (const char **)tfi_state.prefix) != ESPANK_SUCCESS) {
		slurm_error("tfimage: task: cannot wrap the task in %s", tfi_state.image);
		return -1;
	}
	return 0;
#else
	{
		char **argv = NULL, **env = NULL, **full;
		int argc = 0, n = 0;

		if (spank_get_item(sp, S_JOB_ARGV, &argc, &argv) != ESPANK_SUCCESS ||
		    spank_get_item(sp, S_JOB_ENV, &env) != ESPANK_SUCCESS) {
			slurm_error("tfimage: task: cannot read the task's command");
			return -1;
		}
		full = calloc((size_t)(tfi_state.prefix_len + argc + 1), sizeof(char *));
		if (!full) {
			slurm_error("tfimage: task: out of memory");
			return -1;
		}
		for (int i = 0; i < tfi_state.prefix_len; i++)
			full[n++] = tfi_state.prefix[i];
		for (int i = 0; i < argc; i++)
			full[n++] = argv[i];
		full[n] = NULL;
		/* Slurm < 23.11 has no way to prepend: become the runtime ourselves. */
		execve(full[0], full, env);
		slurm_error("tfimage: task: cannot run %s: %s", full[0], strerror(errno));
		free(full);
		return -1;
	}
#endif
}

void tfi_node_exit(spank_t sp)
{
	(void)sp;
	free(tfi_state.prefix_buf);
	tfi_state.prefix_buf = NULL;
}
