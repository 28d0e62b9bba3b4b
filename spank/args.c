/* plugstack.conf arguments: helper=PATH config=PATH daemon=SOCKET pin_socket=SOCKET
 * submit_timeout=S prepare_timeout=S state_dir=PATH (wire.PLUGSTACK_KEYS); the defaults are
 * wire.h's, which are agent/core/wire.py's, which the config's are too. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "tfimage.h"

static int set_path(char *dst, const char *val, const char *key)
{
	if (val[0] != '/' || strlen(val) >= TFI_MAX_PATH) {
		slurm_error("tfimage: plugstack: %s= needs an absolute path", key);
		return -1;
	}
	strcpy(dst, val);
	return 0;
}

static int set_secs(int *dst, const char *val, const char *key)
{
	char *end;
	long v;

	errno = 0;
	v = strtol(val, &end, 10);
	if (errno || *end || v <= 0 || v > 86400) {
		slurm_error("tfimage: plugstack: %s= needs seconds between 1 and 86400", key);
		return -1;
	}
	*dst = (int)v;
	return 0;
}

int tfi_parse_args(int ac, char **av)
{
	strcpy(tfi_conf.helper, TFI_DEFAULT_HELPER);
	strcpy(tfi_conf.config, TFI_DEFAULT_CONFIG);
	tfi_conf.submit_timeout = TFI_DEFAULT_SUBMIT_TIMEOUT;
	/* the config's default hook_deadline, and the grace beyond it */
	tfi_conf.prepare_timeout = TFI_DEFAULT_HOOK_DEADLINE + TFI_HOOK_GRACE;
	tfi_conf.daemon[0] = '\0';
	tfi_conf.pin_socket[0] = '\0';
	tfi_conf.state_dir[0] = '\0';

	for (int i = 0; i < ac; i++) {
		const char *a = av[i];
		int rc;

		if (strncmp(a, "helper=", 7) == 0)
			rc = set_path(tfi_conf.helper, a + 7, "helper");
		else if (strncmp(a, "config=", 7) == 0)
			rc = set_path(tfi_conf.config, a + 7, "config");
		else if (strncmp(a, "daemon=", 7) == 0)
			rc = set_path(tfi_conf.daemon, a + 7, "daemon");
		else if (strncmp(a, "pin_socket=", 11) == 0)
			rc = set_path(tfi_conf.pin_socket, a + 11, "pin_socket");
		else if (strncmp(a, "submit_timeout=", 15) == 0)
			rc = set_secs(&tfi_conf.submit_timeout, a + 15, "submit_timeout");
		else if (strncmp(a, "prepare_timeout=", 16) == 0)
			rc = set_secs(&tfi_conf.prepare_timeout, a + 16, "prepare_timeout");
		else if (strncmp(a, "state_dir=", 10) == 0)
			rc = set_path(tfi_conf.state_dir, a + 10, "state_dir");
		else {
			slurm_error("tfimage: plugstack: unknown argument '%s'", a);
			rc = -1;
		}
		if (rc != 0)
			return -1;
	}
	return 0;
}
