/*
 * A stand-in for a site's own SPANK plugin, already in plugstack.conf before
 * tfimage is deployed: the tests check that it still loads (srun --help lists
 * --site-hello) after the Ansible role has added tfimage beside it.
 */
#include <stddef.h>
#include <slurm/spank.h>

SPANK_PLUGIN(site_hello, 1);

static int hello_cb(int val, const char *optarg, int remote)
{
	(void)val; (void)optarg; (void)remote;
	return 0;
}

/* Slurm refuses a plugin that exports no slurm_spank_* function. */
int slurm_spank_init(spank_t sp, int ac, char **av)
{
	(void)sp; (void)ac; (void)av;
	return 0;
}

struct spank_option spank_options[] = {
	{ "site-hello", NULL, "the site's own plugin (local cluster stand-in)", 0, 0, hello_cb },
	SPANK_OPTIONS_TABLE_END
};
