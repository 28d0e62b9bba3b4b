/* Spawn a program (the tfimage helper): no shell, a fixed environment, a hard
 * deadline, and its stderr kept so the caller can replay it only when something
 * failed. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tfimage.h"

#define MAX_OUT TFI_MAX_ANSWER
#define MAX_ERR 4096

long long tfi_now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void tfi_last_line(const char *buf, size_t len, char *dst, size_t dstlen)
{
	size_t end = len, start;

	while (end > 0 && (buf[end - 1] == '\n' || buf[end - 1] == '\r'))
		end--;
	start = end;
	while (start > 0 && buf[start - 1] != '\n')
		start--;
	if (end - start >= dstlen)
		start = end - (dstlen - 1);
	memcpy(dst, buf + start, end - start);
	dst[end - start] = '\0';
}

int tfi_spawn(char *const argv[], int timeout_s, char **out, size_t *out_len,
		   char *errbuf, size_t errlen)
{
	static char *const envp[] = { "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C.UTF-8",
				      "PYTHONDONTWRITEBYTECODE=1", NULL };
	int po[2], pe[2], status = 0, done = 0;
	char errtail[MAX_ERR];
	size_t errn = 0, cap = 65536, n = 0;
	char *buf;
	pid_t pid;
	long long deadline = tfi_now_ms() + (long long)timeout_s * 1000;

	*out = NULL;
	*out_len = 0;
	errbuf[0] = '\0';
	if (!(buf = malloc(cap))) {
		snprintf(errbuf, errlen, "out of memory");
		return -1;
	}
	if (pipe2(po, O_CLOEXEC) < 0) {
		free(buf);
		snprintf(errbuf, errlen, "pipe: %s", strerror(errno));
		return -1;
	}
	if (pipe2(pe, O_CLOEXEC) < 0) {
		close(po[0]);
		close(po[1]);
		free(buf);
		snprintf(errbuf, errlen, "pipe: %s", strerror(errno));
		return -1;
	}
	pid = fork();
	if (pid < 0) {
		snprintf(errbuf, errlen, "fork: %s", strerror(errno));
		close(po[0]); close(po[1]); close(pe[0]); close(pe[1]);
		free(buf);
		return -1;
	}
	if (pid == 0) {
		int devnull = open("/dev/null", O_RDONLY);

		setpgid(0, 0);
		signal(SIGPIPE, SIG_DFL);
		if (devnull < 0 || dup2(devnull, 0) < 0 || dup2(po[1], 1) < 0 || dup2(pe[1], 2) < 0)
			_exit(127);
		closefrom(3);
		execve(argv[0], argv, envp);
		dprintf(2, "cannot run %s: %s\n", argv[0], strerror(errno));
		_exit(127);
	}
	close(po[1]);
	close(pe[1]);

	while (done < 2) {
		struct pollfd fds[2] = { { po[0], POLLIN, 0 }, { pe[0], POLLIN, 0 } };
		long long left = deadline - tfi_now_ms();
		int rc;

		if (left <= 0) {
			kill(-pid, SIGKILL);
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			snprintf(errbuf, errlen, "%s did not finish within %d s", argv[0], timeout_s);
			close(po[0]);
			close(pe[0]);
			free(buf);
			return TFI_SPAWN_TIMEOUT;
		}
		if (fds[0].fd < 0 && fds[1].fd < 0)
			break;
		rc = poll(fds, 2, (int)(left > 1000 ? 1000 : left));
		if (rc < 0 && errno != EINTR)
			break;
		if (rc <= 0)
			continue;
		if (fds[0].revents) {
			ssize_t r;

			if (n + 4096 > cap && cap < MAX_OUT) {
				char *nb = realloc(buf, cap * 2);
				if (nb) {
					buf = nb;
					cap *= 2;
				}
			}
			r = (n < cap) ? read(po[0], buf + n, cap - n) : read(po[0], errtail, 1);
			if (r <= 0) {
				close(po[0]);
				po[0] = -1;
				done++;
			} else if (n < cap) {
				n += (size_t)r;
			}
		}
		if (fds[1].revents) {
			char tmp[1024];
			ssize_t r = read(pe[0], tmp, sizeof(tmp));

			if (r <= 0) {
				close(pe[0]);
				pe[0] = -1;
				done++;
			} else {
				/* keep the tail: the last line is the one that explains */
				if (errn + (size_t)r > sizeof(errtail)) {
					size_t drop = errn + (size_t)r - sizeof(errtail);
					memmove(errtail, errtail + drop, errn - drop);
					errn -= drop;
				}
				memcpy(errtail + errn, tmp, (size_t)r);
				errn += (size_t)r;
			}
		}
		if (po[0] < 0 && pe[0] < 0)
			break;
	}
	if (po[0] >= 0)
		close(po[0]);
	if (pe[0] >= 0)
		close(pe[0]);
	/* Pipes closed does not mean exited: keep the deadline while reaping. */
	for (;;) {
		pid_t w = waitpid(pid, &status, WNOHANG);

		if (w == pid || (w < 0 && errno != EINTR))
			break;
		if (tfi_now_ms() > deadline) {
			kill(-pid, SIGKILL);
			kill(pid, SIGKILL);
			waitpid(pid, &status, 0);
			snprintf(errbuf, errlen, "%s did not finish within %d s", argv[0], timeout_s);
			free(buf);
			return TFI_SPAWN_TIMEOUT;
		}
		usleep(2000);
	}
	tfi_last_line(errtail, errn, errbuf, errlen);
	*out = buf;
	*out_len = n;
	if (WIFEXITED(status))
		return WEXITSTATUS(status);
	if (!errbuf[0])
		snprintf(errbuf, errlen, "%s was killed by signal %d", argv[0], WTERMSIG(status));
	return -1;
}
