/* The daemon's client: ask the node's tfimage daemon (a warm Python process,
 * `tfimage daemon`) to run a helper command or a hook, instead of starting Python
 * for every step.  The framing is agent/core/wire.py's (1): one request per connection,
 * TFI_WIRE_MAGIC and its NUL, the arguments each NUL-terminated, then the writing
 * side shut; the answer is the status (int32 BE), stderr's length (uint32 BE),
 * stderr, stdout to EOF.
 * No daemon (no socket, connection refused) returns -2: the caller falls back to
 * running the helper itself, so a stopped daemon costs speed, never a job.  Once
 * a daemon took the request, its answer (or its silence, bounded by the same
 * deadline) is final. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "tfimage.h"

#define MAX_OUT TFI_MAX_ANSWER
#define MAX_REQ (1 << 20)

/* Wait for fd to be ready for `events` before the deadline: 1 ready, 0 timed out. */
static int wait_fd(int fd, short events, long long deadline)
{
	for (;;) {
		struct pollfd p = { fd, events, 0 };
		long long left = deadline - tfi_now_ms();
		int rc;

		if (left <= 0)
			return 0;
		rc = poll(&p, 1, (int)(left > 1000 ? 1000 : left));
		if (rc > 0)
			return 1;
		if (rc < 0 && errno != EINTR)
			return -1;
	}
}

static int send_all(int fd, const char *buf, size_t len, long long deadline)
{
	while (len > 0) {
		ssize_t w;

		if (wait_fd(fd, POLLOUT, deadline) != 1)
			return -1;
		w = send(fd, buf, len, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (w < 0 && (errno == EAGAIN || errno == EINTR))
			continue;
		if (w <= 0)
			return -1;
		buf += w;
		len -= (size_t)w;
	}
	return 0;
}

int tfi_ask_daemon(const char *sock, char *const argv[], int timeout_s, char **out,
		    size_t *out_len, char *errbuf, size_t errlen)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	long long deadline = tfi_now_ms() + (long long)timeout_s * 1000;
	char *req = NULL, *buf = NULL;
	size_t reqn = 5, cap = 65536, n = 0;
	int fd, rc = -2, unread = 0;

	*out = NULL;
	*out_len = 0;
	errbuf[0] = '\0';
	if (!sock[0] || strlen(sock) >= sizeof(sa.sun_path))
		return -2;
	strcpy(sa.sun_path, sock);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -2;
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		close(fd);
		return -2; /* no daemon here: the caller runs the helper */
	}
	for (int i = 1; argv[i]; i++)
		reqn += strlen(argv[i]) + 1;
	if (reqn > MAX_REQ || !(req = malloc(reqn)) || !(buf = malloc(cap)))
		goto out;
	memcpy(req, TFI_WIRE_MAGIC, 5);
	for (int i = 1, off = 5; argv[i]; i++) {
		size_t l = strlen(argv[i]) + 1;

		memcpy(req + off, argv[i], l);
		off += (int)l;
	}
	errno = 0;
	if (send_all(fd, req, reqn, deadline) < 0) {
		/* A server that answers before it reads (the pin server's "busy") may
		 * have closed its end first: its answer is waiting all the same. */
		if (errno != EPIPE && errno != ECONNRESET)
			goto out;
		unread = 1;
	} else {
		shutdown(fd, SHUT_WR);
	}
	for (;;) {
		ssize_t r;
		int ready = wait_fd(fd, POLLIN, deadline);

		if (ready == 0) {
			snprintf(errbuf, errlen, "the tfimage daemon did not answer within %d s",
				 timeout_s);
			rc = -1;
			goto out;
		}
		if (ready < 0)
			break;
		if (n == cap) {
			char *nb;

			if (cap >= MAX_OUT + 8 + 4096)
				break;
			if (!(nb = realloc(buf, cap * 2)))
				break;
			buf = nb;
			cap *= 2;
		}
		r = recv(fd, buf + n, cap - n, MSG_DONTWAIT);
		if (r < 0 && (errno == EAGAIN || errno == EINTR))
			continue;
		if (r <= 0)
			break;
		n += (size_t)r;
	}
	if (n < 8 && unread)
		goto out; /* closed before it read the request: nothing ran (-2) */
	if (n < 8) {
		/* it took the request and died: don't run the step's preparation twice */
		snprintf(errbuf, errlen, "the tfimage daemon closed without an answer");
		rc = -1;
		goto out;
	}
	{
		uint32_t st, elen;
		int32_t status;
		char *errs;

		memcpy(&st, buf, 4);
		memcpy(&elen, buf + 4, 4);
		status = (int32_t)ntohl(st);
		elen = ntohl(elen);
		if (elen > n - 8) {
			snprintf(errbuf, errlen, "the tfimage daemon sent a short answer");
			rc = -1;
			goto out;
		}
		errs = buf + 8;
		tfi_last_line(errs, elen, errbuf, errlen); /* what explains a failure */
		memmove(buf, buf + 8 + elen, n - 8 - elen);
		*out_len = n - 8 - elen;
		*out = buf;
		buf = NULL;
		rc = status < 0 ? -1 : status;
		if (status < 0 && !errbuf[0])
			snprintf(errbuf, errlen, "the tfimage daemon's worker was killed");
	}
out:
	free(req);
	free(buf);
	close(fd);
	return rc;
}
