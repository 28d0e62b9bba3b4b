/*
 * What a CUDA program inside a container sees of NVML: loads libnvidia-ml.so.1
 * through the normal library search (the driver tfimage bound in), prints the GPU
 * count and each GPU's UUID, one per line; "no driver: REASON" and exit 2 when the
 * library is not there.  Only libc, dlopen and printf: it runs in any glibc image.
 */
#include <dlfcn.h>
#include <stdio.h>

typedef int (*init_fn)(void);
typedef int (*count_fn)(unsigned *);
typedef int (*handle_fn)(unsigned, void **);
typedef int (*uuid_fn)(void *, char *, unsigned);

int main(void)
{
	void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
	if (!lib) {
		printf("no driver: %s\n", dlerror());
		return 2;
	}
	init_fn init = (init_fn)dlsym(lib, "nvmlInit_v2");
	count_fn count = (count_fn)dlsym(lib, "nvmlDeviceGetCount_v2");
	handle_fn handle = (handle_fn)dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
	uuid_fn uuid = (uuid_fn)dlsym(lib, "nvmlDeviceGetUUID");
	unsigned n = 0;
	if (!init || !count || !handle || !uuid || init() != 0 || count(&n) != 0) {
		printf("NVML did not answer\n");
		return 1;
	}
	printf("count=%u\n", n);
	for (unsigned i = 0; i < n; i++) {
		void *h = NULL;
		char id[96] = "";
		if (handle(i, &h) == 0 && uuid(h, id, sizeof id) == 0)
			printf("%s\n", id);
	}
	return 0;
}
