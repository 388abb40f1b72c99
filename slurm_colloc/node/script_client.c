/*
 * colloc's Prolog/Epilog client in C: hand slurmd's request to the node's script server.
 *
 * Why (issue 28, prolog p99 under a burst): slurmd starts one Prolog per job, and a
 * burst puts ~40 of them on a node at once. The Python client (script_client.py) spent
 * ~0.07 s of CPU on its interpreter and imports before its first byte reached the
 * server; this one needs about a millisecond. It does what that client does, on the
 * same wire (script_client.py, MAGIC): find the server for this colloc.conf and node,
 * check that it is root, send slurmd's environment and its own stdio, wait for the
 * worker to take the run, say "go", and exit with the worker's status.
 *
 * It never decides anything itself. Whenever the server is absent, declines, or its
 * worker ends without a status, it execs the Python script (COLLOC_FALLBACK, compiled
 * in) as "COLLOC_FALLBACK --not-served WHY", which runs the script in its own process
 * (and, when WHY is "absent", starts a server for the scripts after it). If even that
 * exec fails it exits 0: a non-zero Prolog or Epilog drains the node.
 *
 * Built per script by slurm_colloc.node.script_client_build:
 *   cc -O2 -DCOLLOC_SCRIPT='"prolog"' -DCOLLOC_FALLBACK='"/venv/bin/colloc-prolog"'
 *      [-DCOLLOC_RUN_DIR='"/run/colloc-scripts"'] -o colloc-prolog-client script_client.c
 * Trust: as script_client.py. Root's 0700 run directory, the peer's SO_PEERCRED uid
 * must be ours, nothing read from anywhere a user can write.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifndef COLLOC_SCRIPT
#error "COLLOC_SCRIPT (prolog or epilog) must be defined"
#endif
#ifndef COLLOC_FALLBACK
#error "COLLOC_FALLBACK (the Python console script) must be defined"
#endif
#ifndef COLLOC_RUN_DIR
#define COLLOC_RUN_DIR "/run/colloc-scripts"
#endif
#ifndef COLLOC_NICE
#define COLLOC_NICE (-5) /* priority.SCRIPT_NICE: its job waits for it */
#endif

#define MAGIC "colloc-script/2"
#define MAX_REQUEST (1 << 20)  /* script_client.MAX_REQUEST */
#define START_WAIT_MS 5000     /* script_client.START_WAIT_S */
#define ACK_WAIT_MS 5000       /* script_client.ACK_WAIT_S */
#define POLL_MS 20

extern char **environ;

/* what `colloc doctor` reads to find the Python script behind this client */
__attribute__((used)) static const char MARK[] = "colloc-script-client fallback=" COLLOC_FALLBACK;

/* script_client.server_key: FNV-1a 64 of COLLOC_CONF NUL SLURMD_NODENAME, 16 hex */
static void server_key(char out[17])
{
	uint64_t h = 0xcbf29ce484222325ULL;
	const char *parts[2] = {getenv("COLLOC_CONF"), getenv("SLURMD_NODENAME")};
	for (int i = 0; i < 2; i++) {
		for (const unsigned char *p = (const unsigned char *)(parts[i] ? parts[i] : ""); *p; p++)
			h = (h ^ *p) * 0x100000001b3ULL;
		if (i == 0)
			h = (h ^ 0) * 0x100000001b3ULL;
	}
	snprintf(out, 17, "%016llx", (unsigned long long)h);
}

/* script_client._fill_stdio: /dev/null on fds 0-2 slurmd left closed */
static void fill_stdio(void)
{
	for (int fd = 0; fd < 3; fd++) {
		struct stat st;
		if (fstat(fd, &st) == 0)
			continue;
		int null = open("/dev/null", O_RDWR);
		if (null >= 0 && null != fd)
			close(null);
	}
}

/* script_client.private_dir */
static int private_dir(const char *path)
{
	struct stat st;
	if (lstat(path, &st) != 0)
		return 0;
	return S_ISDIR(st.st_mode) && st.st_uid == geteuid() && !(st.st_mode & 077);
}

/* script_client._starting: another process holds the server's lock */
static int starting(const char *lock)
{
	int fd = open(lock, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return 0;
	int held = flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
	close(fd);
	return held;
}

static int connect_to(const char *path)
{
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	if (strlen(path) >= sizeof(addr.sun_path))
		return -1;
	strcpy(addr.sun_path, path);
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		return -1;
	/* a stuck server's full backlog, or one not reading a request, must end in the
	   fallback, never a hang: connect and sends time out (the status wait does not) */
	struct timeval tv = {.tv_sec = ACK_WAIT_MS / 1000};
	setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	if (connect(s, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
		close(s);
		return -1;
	}
	return s;
}

/* script_client._reach: a connection, waiting for a server being started */
static int reach(const char *sock, const char *lock)
{
	int s = connect_to(sock);
	if (s >= 0 || !starting(lock))
		return s;
	struct timespec t0, now;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		clock_gettime(CLOCK_MONOTONIC, &now);
		if ((now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000 >=
		    START_WAIT_MS)
			break;
		usleep(POLL_MS * 1000);
		s = connect_to(sock);
		if (s >= 0)
			return s;
		if (!starting(lock))
			return -1;
	}
	return -1;
}

/* script_client.process_start: this process's start on CLOCK_BOOTTIME, or -1 */
static double process_start(void)
{
	char buf[4096];
	int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = 0;
	char *p = strrchr(buf, ')');
	if (!p)
		return -1;
	p++;
	for (int field = 0; field < 19; field++) { /* starttime is the 20th after ")" */
		p += strspn(p, " ");
		p += strcspn(p, " ");
	}
	char *end;
	unsigned long long ticks = strtoull(p, &end, 10);
	long hz = sysconf(_SC_CLK_TCK);
	return end == p || hz <= 0 ? -1 : (double)ticks / hz;
}

static double cpu_seconds(void)
{
	struct rusage ru;
	if (getrusage(RUSAGE_SELF, &ru) != 0)
		return 0;
	return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec +
	       (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

struct buf {
	char *data;
	size_t len, cap;
};

static int put(struct buf *b, const char *s, size_t n)
{
	if (b->len + n + 1 > MAX_REQUEST)
		return -1;
	if (b->len + n + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 16384;
		while (cap < b->len + n + 1)
			cap *= 2;
		char *d = realloc(b->data, cap);
		if (!d)
			return -1;
		b->data = d;
		b->cap = cap;
	}
	memcpy(b->data + b->len, s, n);
	b->data[b->len + n] = 0; /* each field is NUL-terminated on the wire */
	b->len += n + 1;
	return 0;
}

static int put_str(struct buf *b, const char *s) { return put(b, s, strlen(s)); }

static int send_all(int s, const char *p, size_t n)
{
	while (n) {
		ssize_t k = send(s, p, n, MSG_NOSIGNAL);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		p += k;
		n -= (size_t)k;
	}
	return 0;
}

/* one reply line into line[]; 0 on success, -1 on EOF, timeout or error */
static int read_line(int s, char *line, size_t size, int timeout_ms)
{
	size_t n = 0;
	for (;;) {
		if (timeout_ms >= 0) {
			struct pollfd p = {.fd = s, .events = POLLIN};
			int r = poll(&p, 1, timeout_ms);
			if (r < 0 && errno == EINTR)
				continue;
			if (r <= 0)
				return -1;
		}
		char c;
		ssize_t k = recv(s, &c, 1, 0);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		if (c == '\n') {
			line[n] = 0;
			return 0;
		}
		if (n + 1 < size) /* a longer line is kept cut, as the Python client's is */
			line[n++] = c;
	}
}

/* The run offered to the server: NULL and *status when served, else why not. */
static const char *serve(int *status, char *why, size_t why_size)
{
	char key[17], sock_path[256], lock_path[256];
	if (!private_dir(COLLOC_RUN_DIR))
		return "absent";
	server_key(key);
	snprintf(sock_path, sizeof(sock_path), "%s/script-%s.sock", COLLOC_RUN_DIR, key);
	snprintf(lock_path, sizeof(lock_path), "%s/script-%s.lock", COLLOC_RUN_DIR, key);
	int s = reach(sock_path, lock_path);
	if (s < 0)
		return "absent";
	struct ucred cred;
	socklen_t len = sizeof(cred);
	if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != geteuid()) {
		close(s);
		return "the socket's peer is not root";
	}
	int fds[3], nfds = 0;
	char stdio[8] = "", num[64];
	for (int fd = 0; fd < 3; fd++) {
		struct stat st;
		if (fstat(fd, &st) != 0)
			continue;
		fds[nfds++] = fd;
		snprintf(stdio + strlen(stdio), sizeof(stdio) - strlen(stdio), "%s%d",
			 nfds > 1 ? "," : "", fd);
	}
	struct buf body = {0};
	double started = process_start();
	int bad = put_str(&body, MAGIC) || put_str(&body, COLLOC_SCRIPT);
	if (started >= 0)
		snprintf(num, sizeof(num), "%.6f", started);
	else
		num[0] = 0;
	bad = bad || put_str(&body, num);
	snprintf(num, sizeof(num), "%.6f", cpu_seconds());
	bad = bad || put_str(&body, num) || put_str(&body, stdio);
	for (char **e = environ; !bad && *e; e++)
		bad = put_str(&body, *e);
	if (bad) {
		free(body.data);
		close(s);
		return "request too large";
	}
	/* the 4-byte length, with the stdio descriptors (script_server._receive) */
	uint32_t size = htonl((uint32_t)body.len);
	struct iovec iov = {.iov_base = &size, .iov_len = sizeof(size)};
	union {
		char buf[CMSG_SPACE(sizeof(fds))];
		struct cmsghdr align;
	} control;
	struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
	if (nfds) {
		msg.msg_control = control.buf;
		msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
		struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
		memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
	}
	ssize_t sent;
	do
		sent = sendmsg(s, &msg, MSG_NOSIGNAL);
	while (sent < 0 && errno == EINTR);
	int ok = sent == (ssize_t)sizeof(size) && send_all(s, body.data, body.len) == 0;
	free(body.data);
	char line[1024];
	if (!ok || read_line(s, line, sizeof(line), ACK_WAIT_MS) != 0) {
		close(s);
		return "no answer from the server";
	}
	if (strcmp(line, "taken") != 0) {
		close(s);
		if (strncmp(line, "declined ", 9) == 0 && line[9]) {
			snprintf(why, why_size, "%s", line + 9);
			return why;
		}
		return "no answer from the server";
	}
	/* committed: from here the worker runs it, never both */
	if (send_all(s, "go\n", 3) != 0 || read_line(s, line, sizeof(line), -1) != 0 ||
	    strncmp(line, "status ", 7) != 0) {
		close(s);
		return "the server's worker ended without a status";
	}
	char *end;
	long v = strtol(line + 7, &end, 10);
	close(s);
	if (end == line + 7 || *end)
		return "the server's worker ended without a status";
	*status = (int)v;
	return NULL;
}

int main(void)
{
	/* priority.raise_process: its job waits for it, from its first instruction */
	errno = 0;
	int nice_now = getpriority(PRIO_PROCESS, 0);
	if (errno == 0 && nice_now > COLLOC_NICE)
		setpriority(PRIO_PROCESS, 0, COLLOC_NICE);
	fill_stdio();
	int status = 0;
	char why_buf[1024];
	const char *why = serve(&status, why_buf, sizeof(why_buf));
	if (!why)
		return status;
	char *const argv[] = {COLLOC_FALLBACK, "--not-served", (char *)why, NULL};
	execv(COLLOC_FALLBACK, argv);
	signal(SIGPIPE, SIG_IGN); /* a closed stderr must not turn exit 0 into a signal */
	fprintf(stderr, "colloc: %s client: cannot run %s: %s\n", COLLOC_SCRIPT, COLLOC_FALLBACK,
		strerror(errno));
	return 0; /* never drain the node */
}
