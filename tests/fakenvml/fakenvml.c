/*
 * A fake libnvidia-ml.so.1 for tests: the real nvidia-ml-py loads it through the
 * normal library search (LD_LIBRARY_PATH), and every answer comes from a JSON file
 * named by $FAKE_NVML_STATE, or else (for processes whose environment is cleared, as
 * the node daemon's is) FAKE_NVML_DIR/state-HOSTNAME.json (a node of the local
 * cluster: each has its own hostname), then FAKE_NVML_DIR/state.json, FAKE_NVML_DIR
 * given when it is built; read afresh at each nvmlInit*.  No Python is patched.
 *
 *   {"init": "SUCCESS",                     or an error name: DRIVER_NOT_LOADED, ...
 *    "hang_s": 30,                          nvmlInit stops answering for that long,
 *                                           as a driver with a GPU off the bus does
 *    "abort": true,                         nvmlInit crashes the process (SIGABRT)
 *    "signal": 9,                           nvmlInit's process gets that signal
 *    "driver": "550.54.15",
 *    "devices": [
 *      {"uuid": "GPU-...", "pci": "00000000:3B:00.0", "minor": 0,
 *       "handle": "SUCCESS",                or GPU_IS_LOST, RESET_REQUIRED, ...
 *       "ecc_dbe_volatile": 0, "ecc_sbe_volatile": 0,
 *       "remapped": [corr, unc, pending, failure],
 *       "retired_pending": 0, "retired_sbe": 0, "retired_dbe": 0,
 *       "inforom": "SUCCESS",               or CORRUPTED_INFOROM
 *       "recovery_action": 0,
 *       "processes": [{"pid": 4242, "mem": 1048576}],
 *       "nvlinks": [1, 1, 0],               a link per entry: 1 up, 0 down
 *       "energy_mj": 123456, "clock_events": 0, "persistence": 1,
 *       "pcie": [cur_width, max_width, cur_gen, max_gen],
 *       "errors": {"nvmlDeviceGetRemappedRows": "FUNCTION_NOT_FOUND"}}]}
 *
 * A key left out answers NOT_SUPPORTED, as a GPU without the feature does; "errors"
 * makes any one function answer the named error instead.
 *
 * As the real library does, a GPU whose device file this process may not open
 * (EPERM: Slurm's ConstrainDevices denied it to the job's cgroup) is not listed, and
 * the others are numbered from 0.  The files are DEV_DIR/nvidia<minor>: $FAKE_NVML_DEV_DIR,
 * else FAKE_NVML_DEV_DIR given at build; a missing file hides nothing.  The
 * library needs nothing but libc, so it also works bound into a container.  No
 * _GNU_SOURCE: built on a newer glibc, it must still load under an older one (the
 * other Slurm generation's tree), and glibc >= 2.38 redirects GNU builds to
 * __isoc23_* symbols an older one lacks.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef FAKE_NVML_DIR
#define FAKE_NVML_DIR "."
#endif
#ifndef FAKE_NVML_DEV_DIR
#define FAKE_NVML_DEV_DIR "/dev"
#endif

typedef int nvmlReturn_t;
typedef struct fake_device *nvmlDevice_t;

enum { OK = 0, UNINITIALIZED = 1, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3,
       NOT_FOUND = 6, INSUFFICIENT_SIZE = 7, UNKNOWN = 999 };

/* --- a small JSON reader ----------------------------------------------------- */

enum jtype { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ };

struct json {
	enum jtype type;
	double num;
	char *str;
	char *key;          /* in an object: this member's name */
	struct json *kids;  /* array elements or object members */
	size_t nkids;
};

struct reader { const char *p, *end; int bad; };

static void skip_ws(struct reader *r)
{
	while (r->p < r->end && strchr(" \t\r\n", *r->p))
		r->p++;
}

static char *read_string(struct reader *r)
{
	if (r->p >= r->end || *r->p != '"') { r->bad = 1; return NULL; }
	r->p++;
	char *out = malloc((size_t)(r->end - r->p) + 1);
	size_t n = 0;
	while (r->p < r->end && *r->p != '"') {
		char c = *r->p++;
		if (c == '\\' && r->p < r->end) {
			c = *r->p++;
			if (c == 'n') c = '\n';
			else if (c == 't') c = '\t';
		}
		out[n++] = c;
	}
	if (r->p >= r->end) { r->bad = 1; free(out); return NULL; }
	r->p++;
	out[n] = 0;
	return out;
}

static void read_value(struct reader *r, struct json *v, int depth);

static void read_members(struct reader *r, struct json *v, char close, int depth)
{
	r->p++;
	size_t cap = 0;
	skip_ws(r);
	if (r->p < r->end && *r->p == close) { r->p++; return; }
	for (;;) {
		if (v->nkids == cap) {
			cap = cap ? cap * 2 : 8;
			v->kids = realloc(v->kids, cap * sizeof *v->kids);
		}
		struct json *k = &v->kids[v->nkids];
		memset(k, 0, sizeof *k);
		skip_ws(r);
		if (close == '}') {
			k->key = read_string(r);
			skip_ws(r);
			if (r->bad || r->p >= r->end || *r->p != ':') { r->bad = 1; return; }
			r->p++;
		}
		read_value(r, k, depth + 1);
		if (r->bad) return;
		v->nkids++;
		skip_ws(r);
		if (r->p < r->end && *r->p == ',') { r->p++; continue; }
		if (r->p < r->end && *r->p == close) { r->p++; return; }
		r->bad = 1;
		return;
	}
}

static void read_value(struct reader *r, struct json *v, int depth)
{
	skip_ws(r);
	if (depth > 32 || r->p >= r->end) { r->bad = 1; return; }
	char c = *r->p;
	if (c == '{') { v->type = J_OBJ; read_members(r, v, '}', depth); }
	else if (c == '[') { v->type = J_ARR; read_members(r, v, ']', depth); }
	else if (c == '"') { v->type = J_STR; v->str = read_string(r); }
	else if (!strncmp(r->p, "true", 4)) { v->type = J_BOOL; v->num = 1; r->p += 4; }
	else if (!strncmp(r->p, "false", 5)) { v->type = J_BOOL; r->p += 5; }
	else if (!strncmp(r->p, "null", 4)) { v->type = J_NULL; r->p += 4; }
	else {
		char *e;
		v->type = J_NUM;
		v->num = strtod(r->p, &e);
		if (e == r->p) r->bad = 1;
		r->p = e;
	}
}

static const struct json *member(const struct json *o, const char *key)
{
	if (!o || o->type != J_OBJ) return NULL;
	for (size_t i = 0; i < o->nkids; i++)
		if (!strcmp(o->kids[i].key, key)) return &o->kids[i];
	return NULL;
}

/* --- state ------------------------------------------------------------------- */

struct fake_device { const struct json *j; };

static struct json root;
static int initialised;
static struct fake_device devices[64];
static unsigned ndevices;

static const char *const error_names[] = {
	[0] = "SUCCESS", [1] = "UNINITIALIZED", [2] = "INVALID_ARGUMENT",
	[3] = "NOT_SUPPORTED", [4] = "NO_PERMISSION", [6] = "NOT_FOUND",
	[9] = "DRIVER_NOT_LOADED", [10] = "TIMEOUT", [12] = "LIBRARY_NOT_FOUND",
	[13] = "FUNCTION_NOT_FOUND", [14] = "CORRUPTED_INFOROM", [15] = "GPU_IS_LOST",
	[16] = "RESET_REQUIRED", [17] = "OPERATING_SYSTEM",
	[18] = "LIB_RM_VERSION_MISMATCH", [21] = "NO_DATA", [28] = "GPU_NOT_FOUND",
};

static nvmlReturn_t error_code(const struct json *v)
{
	if (!v || v->type != J_STR) return OK;
	for (size_t i = 0; i < sizeof error_names / sizeof *error_names; i++)
		if (error_names[i] && !strcmp(error_names[i], v->str)) return (nvmlReturn_t)i;
	return UNKNOWN;
}

/* Whether this process may open the GPU's device file (the device cgroup). */
static int allowed(const struct json *dev)
{
	const struct json *minor = member(dev, "minor");
	if (!minor || minor->type != J_NUM) return 1;
	const char *dir = getenv("FAKE_NVML_DEV_DIR");
	char path[PATH_MAX];
	snprintf(path, sizeof path, "%s/nvidia%d", dir ? dir : FAKE_NVML_DEV_DIR, (int)minor->num);
	int fd = open(path, O_RDWR | O_CLOEXEC);
	if (fd >= 0) {
		close(fd);
		return 1;
	}
	return errno != EPERM;
}

static int load(void)
{
	const char *path = getenv("FAKE_NVML_STATE");
	char host[256] = "", own[PATH_MAX];
	FILE *f = NULL;
	if (path) {
		f = fopen(path, "r");
	} else {
		if (gethostname(host, sizeof host - 1) == 0) {
			snprintf(own, sizeof own, "%s/state-%s.json", FAKE_NVML_DIR, host);
			f = fopen(own, "r");
		}
		if (!f)
			f = fopen(FAKE_NVML_DIR "/state.json", "r");
	}
	if (!f) return -1;
	static char buf[1 << 20];
	size_t n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	memset(&root, 0, sizeof root);  /* the previous tree leaks: a test's few KiB */
	struct reader r = { buf, buf + n, 0 };
	read_value(&r, &root, 0);
	if (r.bad || root.type != J_OBJ) return -1;
	const struct json *devs = member(&root, "devices");
	ndevices = 0;
	for (size_t i = 0; devs && devs->type == J_ARR && i < devs->nkids && i < 64; i++)
		if (allowed(&devs->kids[i]))
			devices[ndevices++].j = &devs->kids[i];
	return 0;
}

/* The error a device's function answers instead of its value, if any. */
static nvmlReturn_t forced(nvmlDevice_t d, const char *fn)
{
	if (!initialised) return UNINITIALIZED;
	if (!d || d < devices || d >= devices + ndevices) return INVALID_ARGUMENT;
	nvmlReturn_t handle = error_code(member(d->j, "handle"));
	if (handle) return handle;
	const struct json *errors = member(d->j, "errors");
	return error_code(member(errors, fn));
}

static int number(nvmlDevice_t d, const char *key, double *out)
{
	const struct json *v = member(d->j, key);
	if (!v || (v->type != J_NUM && v->type != J_BOOL)) return 0;
	*out = v->num;
	return 1;
}

#define GUARD(fn) do { nvmlReturn_t e_ = forced(d, fn); if (e_) return e_; } while (0)

/* --- the NVML functions tfimage calls ------------------------------------------ */

nvmlReturn_t nvmlInitWithFlags(unsigned flags)
{
	(void)flags;
	if (load() < 0) return UNKNOWN;
	const struct json *hang = member(&root, "hang_s");
	if (hang && hang->type == J_NUM && hang->num > 0)
		sleep((unsigned)hang->num);
	const struct json *crash = member(&root, "abort");
	if (crash && crash->type == J_BOOL && crash->num)
		abort();
	const struct json *sig = member(&root, "signal");
	if (sig && sig->type == J_NUM && sig->num > 0)
		raise((int)sig->num);
	nvmlReturn_t e = error_code(member(&root, "init"));
	if (e) return e;
	initialised = 1;
	return OK;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
	if (!initialised) return UNINITIALIZED;
	initialised = 0;
	return OK;
}

const char *nvmlErrorString(nvmlReturn_t r)
{
	if (r >= 0 && (size_t)r < sizeof error_names / sizeof *error_names && error_names[r])
		return error_names[r];
	return "Unknown Error";
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *out, unsigned len)
{
	if (!initialised) return UNINITIALIZED;
	const struct json *v = member(&root, "driver");
	if (snprintf(out, len, "%s", v && v->type == J_STR ? v->str : "550.54.15") >= (int)len)
		return INSUFFICIENT_SIZE;
	return OK;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count)
{
	if (!initialised) return UNINITIALIZED;
	*count = ndevices;
	return OK;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *out)
{
	if (!initialised) return UNINITIALIZED;
	if (i >= ndevices) return INVALID_ARGUMENT;
	nvmlReturn_t e = error_code(member(devices[i].j, "handle"));
	if (e) return e;
	*out = &devices[i];
	return OK;
}

static nvmlReturn_t string(nvmlDevice_t d, const char *fn, const char *key, char *out,
			   unsigned len)
{
	GUARD(fn);
	const struct json *v = member(d->j, key);
	if (!v || v->type != J_STR) return NOT_SUPPORTED;
	if (snprintf(out, len, "%s", v->str) >= (int)len) return INSUFFICIENT_SIZE;
	return OK;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *out, unsigned len)
{
	return string(d, "nvmlDeviceGetUUID", "uuid", out, len);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *out, unsigned len)
{
	GUARD("nvmlDeviceGetName");
	const struct json *v = member(d->j, "name");
	snprintf(out, len, "%s", v && v->type == J_STR ? v->str : "Fake GPU");
	return OK;
}

typedef struct {
	char busIdLegacy[16];
	unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
	char busId[32];
} nvmlPciInfo_t;

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *out)
{
	GUARD("nvmlDeviceGetPciInfo_v3");
	const struct json *v = member(d->j, "pci");
	if (!v || v->type != J_STR) return NOT_SUPPORTED;
	memset(out, 0, sizeof *out);
	snprintf(out->busId, sizeof out->busId, "%s", v->str);
	snprintf(out->busIdLegacy, sizeof out->busIdLegacy, "%s", v->str);
	sscanf(v->str, "%x:%x:%x", &out->domain, &out->bus, &out->device);
	return OK;
}

#define UINT_FIELD(name, key)                                              \
	nvmlReturn_t name(nvmlDevice_t d, unsigned *out)                   \
	{                                                                  \
		GUARD(#name);                                              \
		double x;                                                  \
		if (!number(d, key, &x)) return NOT_SUPPORTED;             \
		*out = (unsigned)x;                                        \
		return OK;                                                 \
	}

UINT_FIELD(nvmlDeviceGetMinorNumber, "minor")
UINT_FIELD(nvmlDeviceGetRetiredPagesPendingStatus, "retired_pending")
UINT_FIELD(nvmlDeviceGetPersistenceMode, "persistence")

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned *out)
{
	GUARD("nvmlDeviceGetIndex");
	*out = (unsigned)(d - devices);
	return OK;
}

nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *out)
{
	GUARD("nvmlDeviceGetTotalEnergyConsumption");
	double x;
	if (!number(d, "energy_mj", &x)) return NOT_SUPPORTED;
	*out = (unsigned long long)x;
	return OK;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *out)
{
	GUARD("nvmlDeviceGetCurrentClocksEventReasons");
	double x;
	if (!number(d, "clock_events", &x)) return NOT_SUPPORTED;
	*out = (unsigned long long)x;
	return OK;
}

/* errorType 0 corrected, 1 uncorrected; counterType 0 volatile, 1 aggregate */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int type, int counter,
					 unsigned long long *out)
{
	GUARD("nvmlDeviceGetTotalEccErrors");
	double x;
	const char *key = type == 1 ? (counter == 0 ? "ecc_dbe_volatile" : "ecc_dbe_aggregate")
				    : (counter == 0 ? "ecc_sbe_volatile" : "ecc_sbe_aggregate");
	if (!number(d, key, &x)) return NOT_SUPPORTED;
	*out = (unsigned long long)x;
	return OK;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned *corr, unsigned *unc,
				       unsigned *pending, unsigned *failure)
{
	GUARD("nvmlDeviceGetRemappedRows");
	const struct json *v = member(d->j, "remapped");
	if (!v || v->type != J_ARR || v->nkids != 4) return NOT_SUPPORTED;
	*corr = (unsigned)v->kids[0].num;
	*unc = (unsigned)v->kids[1].num;
	*pending = (unsigned)v->kids[2].num;
	*failure = (unsigned)v->kids[3].num;
	return OK;
}

/* cause 0: multiple single-bit errors, 1: a double-bit error */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t d, int cause, unsigned *count,
				       unsigned long long *addresses)
{
	GUARD("nvmlDeviceGetRetiredPages");
	double x;
	if (!number(d, cause == 1 ? "retired_dbe" : "retired_sbe", &x)) return NOT_SUPPORTED;
	unsigned n = (unsigned)x;
	if (!addresses || *count < n) { *count = n; return n ? INSUFFICIENT_SIZE : OK; }
	for (unsigned i = 0; i < n; i++) addresses[i] = 0x1000ULL * (i + 1);
	*count = n;
	return OK;
}

nvmlReturn_t nvmlDeviceValidateInforom(nvmlDevice_t d)
{
	GUARD("nvmlDeviceValidateInforom");
	const struct json *v = member(d->j, "inforom");
	return v ? error_code(v) : NOT_SUPPORTED;
}

typedef struct {
	unsigned pid;
	unsigned long long usedGpuMemory;
	unsigned gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned *count,
						     nvmlProcessInfo_t *out)
{
	GUARD("nvmlDeviceGetComputeRunningProcesses_v3");
	const struct json *v = member(d->j, "processes");
	unsigned n = v && v->type == J_ARR ? (unsigned)v->nkids : 0;
	if (!out || *count < n) { *count = n; return n ? INSUFFICIENT_SIZE : OK; }
	for (unsigned i = 0; i < n; i++) {
		const struct json *pid = member(&v->kids[i], "pid");
		const struct json *mem = member(&v->kids[i], "mem");
		out[i].pid = pid ? (unsigned)pid->num : 0;
		out[i].usedGpuMemory = mem ? (unsigned long long)mem->num : 0;
		out[i].gpuInstanceId = out[i].computeInstanceId = 0xFFFFFFFFu;
	}
	*count = n;
	return OK;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned link, unsigned *active)
{
	GUARD("nvmlDeviceGetNvLinkState");
	const struct json *v = member(d->j, "nvlinks");
	if (!v || v->type != J_ARR || link >= v->nkids) return NOT_SUPPORTED;
	*active = v->kids[link].num != 0;
	return OK;
}

static nvmlReturn_t pcie(nvmlDevice_t d, const char *fn, size_t i, unsigned *out)
{
	GUARD(fn);
	const struct json *v = member(d->j, "pcie");
	if (!v || v->type != J_ARR || v->nkids != 4) return NOT_SUPPORTED;
	*out = (unsigned)v->kids[i].num;
	return OK;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned *o)
{ return pcie(d, "nvmlDeviceGetCurrPcieLinkWidth", 0, o); }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned *o)
{ return pcie(d, "nvmlDeviceGetMaxPcieLinkWidth", 1, o); }
nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned *o)
{ return pcie(d, "nvmlDeviceGetCurrPcieLinkGeneration", 2, o); }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned *o)
{ return pcie(d, "nvmlDeviceGetMaxPcieLinkGeneration", 3, o); }

typedef struct {
	uint32_t fieldId, scopeId;
	int64_t timestamp, latencyUsec;
	int valueType;
	nvmlReturn_t nvmlReturn;
	union { double d; unsigned ui; unsigned long ul; unsigned long long ull;
		long long sll; int si; unsigned short us; } value;
} nvmlFieldValue_t;

#define FI_GET_GPU_RECOVERY_ACTION 230

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int n, nvmlFieldValue_t *values)
{
	GUARD("nvmlDeviceGetFieldValues");
	for (int i = 0; i < n; i++) {
		double x;
		values[i].valueType = 1;  /* unsigned int */
		if (values[i].fieldId == FI_GET_GPU_RECOVERY_ACTION &&
		    number(d, "recovery_action", &x)) {
			values[i].nvmlReturn = OK;
			values[i].value.ui = (unsigned)x;
		} else {
			values[i].nvmlReturn = NOT_SUPPORTED;
		}
	}
	return OK;
}
