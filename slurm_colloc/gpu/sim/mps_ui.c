/*
 * colloc-sim-mps-control: the MPS stand-in's program as the lab installs it (a lab tool).
 *
 * Without arguments it is the control client, as nvidia-cuda-mps-control is: each
 * stdin line goes to the daemon on $CUDA_MPS_PIPE_DIRECTORY/control (SEQPACKET,
 * first line "UI"), each answer (ended by NUL) is printed. mps_ui.py is the same
 * client in Python; mps_protocol.py documents the wire.
 *
 * With arguments (-d, -f, ...) it runs the Python stand-in: it execs
 * "PYTHON <this file> ARGS...", and this file ends in a zip archive whose __main__.py
 * runs slurm_colloc.gpu.sim.mps_control (slurm_colloc.gpu.sim.tools writes it). So
 * the daemon's argv is "python <launcher> -d", as with the Python launcher, and root's
 * identity check of the daemon (slurm_colloc.mps.control) sees the configured path.
 *
 * Why (issue 28): NVIDIA's client answers the prolog's cap runs in 0.005-0.007 s on an
 * H200 (benchmarks/results/hardware/h200_mps_cap.json); a Python client cost 0.02-0.075 s
 * of CPU, 0.05-0.5 s of wall on the lab's loaded cores, and the GPU's other prologs
 * waited for those runs: the simulation, not colloc, made the burst's tail.
 *
 *   cc -O2 -DPYTHON='"/venv/bin/python3"' -o colloc-sim-mps-control mps_ui.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#ifndef PYTHON
#error "PYTHON (the interpreter of the Python stand-in) must be defined"
#endif

#define MAX_ANSWER (1 << 20) /* mps_ui.MAX_ANSWER */
#define TIMEOUT_S 5          /* mps_ui.CONNECT_TIMEOUT_S */

static int run_python(int argc, char **argv)
{
	char self[PATH_MAX];
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n <= 0) {
		perror("colloc-sim-mps-control: /proc/self/exe");
		return 1;
	}
	self[n] = 0;
	char **args = calloc((size_t)argc + 2, sizeof(char *));
	if (!args)
		return 1;
	args[0] = PYTHON;
	args[1] = self;
	for (int i = 1; i < argc; i++)
		args[i + 1] = argv[i];
	execv(PYTHON, args);
	fprintf(stderr, "colloc-sim-mps-control: cannot run %s: %s\n", PYTHON, strerror(errno));
	return 1;
}

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

int main(int argc, char **argv)
{
	if (argc > 1)
		return run_python(argc, argv);
	const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
	if (!dir || !*dir)
		dir = "/tmp/nvidia-mps";
	struct sockaddr_un addr = {.sun_family = AF_UNIX};
	if (snprintf(addr.sun_path, sizeof(addr.sun_path), "%s/control", dir) >=
	    (int)sizeof(addr.sun_path)) {
		fprintf(stderr, "Cannot find MPS control daemon process (cannot connect to MPS "
			"control daemon at %s/control: path too long)\n", dir);
		return 1;
	}
	int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	struct timeval tv = {.tv_sec = TIMEOUT_S};
	if (s >= 0) {
		setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
		setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	}
	if (s < 0 || connect(s, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
		fprintf(stderr, "Cannot find MPS control daemon process (cannot connect to MPS "
			"control daemon at %s: %s)\n", addr.sun_path, strerror(errno));
		return 1;
	}
	char *answer = malloc(MAX_ANSWER + 1), line[4096];
	if (!answer || send_all(s, "UI\n", 3) != 0) {
		fprintf(stderr, "MPS control daemon connection lost: %s\n", strerror(errno));
		return 1;
	}
	while (fgets(line, sizeof(line), stdin)) {
		char *cmd = line + strspn(line, " \t\r\n");
		size_t len = strlen(cmd);
		while (len && strchr(" \t\r\n", cmd[len - 1]))
			cmd[--len] = 0;
		if (!len)
			continue;
		cmd[len] = '\n';
		if (send_all(s, cmd, len + 1) != 0) {
			fprintf(stderr, "MPS control daemon connection lost: %s\n", strerror(errno));
			return 1;
		}
		cmd[len] = 0;
		size_t got = 0;
		char *end = NULL;
		while (!end) {
			if (got >= MAX_ANSWER) {
				fprintf(stderr, "MPS control daemon connection lost: message from MPS "
					"daemon too long\n");
				return 1;
			}
			ssize_t k = recv(s, answer + got, MAX_ANSWER - got, 0);
			if (k < 0 && errno == EINTR)
				continue;
			if (k <= 0) {
				fprintf(stderr, "MPS control daemon connection lost: %s\n",
					k == 0 ? "MPS control daemon closed the connection" : strerror(errno));
				return 1;
			}
			end = memchr(answer + got, 0, (size_t)k);
			got += (size_t)k;
		}
		size_t n = (size_t)(end - answer);
		if (n) { /* as mps_ui.py: a non-empty answer, its trailing newlines as one */
			while (n && answer[n - 1] == '\n')
				n--;
			fwrite(answer, 1, n, stdout);
			fputc('\n', stdout);
			fflush(stdout);
		}
		if (strncmp(cmd, "quit", 4) == 0 && (cmd[4] == 0 || strchr(" \t", cmd[4])))
			break;
	}
	return 0;
}
