/*
 * tfimage-hook: run a tfimage node hook (prolog, epilog) through the node's warm
 * daemon, so the prolog on a job's launch path costs no Python start.
 *
 *   tfimage-hook SOCKET DEADLINE PROGRAM [ARGS...]
 *
 * DEADLINE is the config's hook_deadline: the hook gives up by itself then, and
 * this waits TFI_HOOK_GRACE seconds more for it to say so.
 *
 * The daemon runs PROGRAM's entry point with ARGS; its exit status is this one's
 * (the Python hook's own: non-zero only for a fault of the node, hooks/log.py).
 * When no daemon listens, PROGRAM itself is exec'ed with ARGS and this environment:
 * a hook never depends on the daemon.  Once a daemon took the request, it is never
 * run a second time: no answer in time, or a worker that died, is reported and
 * exits 0 (an image problem never drains a node; the job's steps report it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tfimage.h"

int main(int argc, char **argv)
{
	char err[512], *out = NULL, *req[TFI_MAX_ARGS + 2];
	size_t len = 0;
	long timeout;
	int rc;

	if (argc < 4) {
		fprintf(stderr, "usage: tfimage-hook SOCKET TIMEOUT PROGRAM [ARGS...]\n");
		return 2;
	}
	timeout = strtol(argv[2], NULL, 10);
	if (timeout < 1 || timeout > 86400 || argc - 3 > TFI_MAX_ARGS) {
		fprintf(stderr, "tfimage-hook: bad deadline or too many arguments\n");
		return 0; /* never drain a node over the hook's own arguments */
	}
	/* request: the program's name (its entry point), then its arguments */
	req[0] = argv[3];
	req[1] = strrchr(argv[3], '/') ? strrchr(argv[3], '/') + 1 : argv[3];
	for (int i = 4; i < argc; i++)
		req[i - 2] = argv[i];
	req[argc - 2] = NULL;
	rc = tfi_ask_daemon(argv[1], req, (int)timeout + TFI_HOOK_GRACE, &out, &len, err,
			     sizeof(err));
	if (rc >= 0) {
		if (len)
			fwrite(out, 1, len, stdout);
		if (err[0])
			fprintf(stderr, "%s\n", err);
		free(out);
		return rc;
	}
	free(out);
	if (rc == -1) {
		/* The daemon took it: running it again could pull twice at once. */
		fprintf(stderr, "tfimage-hook: %s: %s; not run again\n", argv[3], err);
		return 0;
	}
	execv(argv[3], &argv[3]);
	fprintf(stderr, "tfimage-hook: cannot run %s: %s\n", argv[3], strerror(errno));
	return 0; /* never drain a node because the hook could not start */
}
