/*
 * colloc_spank.c - the `sbatch --colloc` options of slurm-colloc.
 *
 * Registers, inside slurm_spank_init() (sbatch 22.05 ignores a static
 * spank_options table in allocator context):
 *
 *   --colloc[=SUMMARY]       share a GPU; SUMMARY is a model summary file to estimate from
 *   --colloc-mem=SIZE        explicit GPU memory (e.g. 8G, 7500M, 7500); skips estimation
 *   --colloc-batch-size=N    passed to the estimator
 *   --colloc-seq-len=L       passed to the estimator
 *   --colloc-optimizer=NAME  sgd|momentum|adam|adamw
 *   --colloc-precision=NAME  fp32|amp-fp16|amp-bf16
 *
 * The plugin only checks the syntax of the values (so a typo fails sbatch at
 * once) and lets Slurm carry them: job_submit.lua sees them in
 * job_desc.spank_job_env as _SLURM_SPANK_OPTION_colloc_<option>=VALUE (dashes
 * become underscores), Prolog/Epilog as SPANK__SLURM_SPANK_OPTION_colloc_<option>
 * and the job as SLURM_SPANK__SLURM_SPANK_OPTION_colloc_<option>.
 * The estimate itself is made by cli_filter.lua and validated by job_submit.lua;
 * nothing here is trusted by the controller.
 *
 * Contexts: options are registered in local (srun), allocator (sbatch, salloc)
 * and remote (slurmstepd) context; the option callbacks validate only where the
 * user typed them (remote == 0). Nothing runs in slurmd or job-script context.
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define MAX_MEM_MIB (16L * 1024 * 1024) /* 16 TiB: far above any GPU; as job_submit.lua */
#define MAX_SIZE_LEN 32 /* as job_submit.lua */

/*
 * SIZE: the grammar of parse_size_mib() in job_submit.lua, exactly:
 *   ^[0-9]+(\.[0-9]*)?([KMGT]([iI]?[bB]?))?$  (unit letters in either case),
 * at most 32 characters; no unit means MiB; K/M/G/T are binary. Nothing else:
 * no sign, blanks, exponent (1e3), hex (0x10), inf/nan. Returns MiB rounded up
 * (at least 1), or -1 for anything malformed, zero or above MAX_MEM_MIB.
 *
 * The number is checked by hand first; strtod() then converts only digits and one
 * '.', as Lua's tonumber() does, and must consume all of them (a locale whose
 * decimal point is not '.' makes it refuse rather than misread).
 */
static long parse_size_mib(const char *s)
{
	char num[MAX_SIZE_LEN + 1];
	const char *p;
	char *end = NULL;
	size_t len, n;
	double v, mult = 1.0;
	long mib;

	if (!s)
		return -1;
	len = strlen(s);
	if (len == 0 || len > MAX_SIZE_LEN)
		return -1;
	p = s;
	if (!(*p >= '0' && *p <= '9'))
		return -1;
	while (*p >= '0' && *p <= '9')
		p++;
	if (*p == '.') {
		p++;
		while (*p >= '0' && *p <= '9')
			p++;
	}
	n = (size_t)(p - s);
	switch (*p) {
	case '\0': break;
	case 'k': case 'K': mult = 1.0 / 1024; break;
	case 'm': case 'M': mult = 1.0; break;
	case 'g': case 'G': mult = 1024.0; break;
	case 't': case 'T': mult = 1024.0 * 1024; break;
	default: return -1;
	}
	if (*p) {
		p++;
		if (*p == 'i' || *p == 'I')
			p++;
		if (*p == 'b' || *p == 'B')
			p++;
		if (*p != '\0')
			return -1;
	}
	memcpy(num, s, n);
	num[n] = '\0';
	errno = 0;
	v = strtod(num, &end);
	if (errno || end != num + n || !(v > 0))
		return -1;
	v = v * mult;
	if (!(v <= (double)MAX_MEM_MIB))
		return -1;
	mib = (long)v;
	if ((double)mib < v)
		mib++;
	return mib < 1 ? 1 : mib;
}

#ifndef COLLOC_SIZE_PARSER_ONLY /* the unit test compiles the parser alone */

#include <slurm/spank.h>
#include <slurm/slurm_version.h>

SPANK_PLUGIN(colloc, 1);

/*
 * The Slurm release whose headers built this plugin, as a string in the binary:
 * Slurm loads a plugin only for its own major release, and an `optional` plugin that
 * does not load just makes sbatch forget --colloc, silently. `colloc admin doctor`
 * reads this (slurm_colloc/site/releases.py, PLUGIN_MARK) and compares it with the
 * release the host runs. Not exported (the version script); `used` keeps it.
 */
#define COLLOC_STR_(x) #x
#define COLLOC_STR(x) COLLOC_STR_(x)
__attribute__((used)) const char colloc_built_for_slurm[] =
	"colloc-slurm-version-number=" COLLOC_STR(SLURM_VERSION_NUMBER);

#define LOG_PREFIX "colloc: "
#define MAX_VALUE_LEN 4096
#define MAX_COUNT 100000000L

enum opt_id {
	OPT_COLLOC = 1,
	OPT_MEM,
	OPT_BATCH,
	OPT_SEQ,
	OPT_OPTIMIZER,
	OPT_PRECISION,
	OPT_ATTENTION,
};

/* What the user typed in this process (allocator/local context only). */
static int seen_colloc, seen_summary, seen_mem, seen_batch, seen_est_arg;

static const char *const optimizers[] = { "sgd", "momentum", "adam", "adamw", NULL };
static const char *const precisions[] = { "fp32", "amp-fp16", "amp-bf16", NULL };
static const char *const attentions[] = { "eager", "sdpa", "flash", NULL };

static int in_list(const char *v, const char *const *list)
{
	for (; *list; list++)
		if (strcmp(v, *list) == 0)
			return 1;
	return 0;
}

/* Positive decimal integer <= max; returns -1 on anything else. */
static long parse_count(const char *s, long max)
{
	char *end = NULL;
	long v;

	if (!s || !isdigit((unsigned char)s[0]))
		return -1;
	errno = 0;
	v = strtol(s, &end, 10);
	if (errno || *end != '\0' || v < 1 || v > max)
		return -1;
	return v;
}

static int check_value(int val, const char *optarg)
{
	if (optarg && strlen(optarg) > MAX_VALUE_LEN) {
		slurm_error(LOG_PREFIX "option value longer than %d characters", MAX_VALUE_LEN);
		return -1;
	}
	switch (val) {
	case OPT_COLLOC:
		seen_colloc = 1;
		if (optarg && optarg[0] != '\0') {
			if (strchr(optarg, '\n')) {
				slurm_error(LOG_PREFIX "--colloc=SUMMARY: file name contains a newline");
				return -1;
			}
			seen_summary = 1;
		}
		return 0;
	case OPT_MEM:
		if (parse_size_mib(optarg) < 0) {
			slurm_error(LOG_PREFIX "--colloc-mem=%s: expected a size such as 8G, 7500M "
				    "or 7500 (MiB)", optarg ? optarg : "");
			return -1;
		}
		seen_mem = 1;
		return 0;
	case OPT_BATCH:
		if (parse_count(optarg, MAX_COUNT) < 0) {
			slurm_error(LOG_PREFIX "--colloc-batch-size=%s: expected a positive integer",
				    optarg ? optarg : "");
			return -1;
		}
		seen_batch = 1;
		seen_est_arg = 1;
		return 0;
	case OPT_SEQ:
		if (parse_count(optarg, MAX_COUNT) < 0) {
			slurm_error(LOG_PREFIX "--colloc-seq-len=%s: expected a positive integer",
				    optarg ? optarg : "");
			return -1;
		}
		seen_est_arg = 1;
		return 0;
	case OPT_OPTIMIZER:
		if (!optarg || !in_list(optarg, optimizers)) {
			slurm_error(LOG_PREFIX "--colloc-optimizer=%s: expected one of "
				    "sgd, momentum, adam, adamw", optarg ? optarg : "");
			return -1;
		}
		seen_est_arg = 1;
		return 0;
	case OPT_PRECISION:
		if (!optarg || !in_list(optarg, precisions)) {
			slurm_error(LOG_PREFIX "--colloc-precision=%s: expected one of "
				    "fp32, amp-fp16, amp-bf16", optarg ? optarg : "");
			return -1;
		}
		seen_est_arg = 1;
		return 0;
	case OPT_ATTENTION:
		if (!optarg || !in_list(optarg, attentions)) {
			slurm_error(LOG_PREFIX "--colloc-attention=%s: expected one of "
				    "eager, sdpa, flash", optarg ? optarg : "");
			return -1;
		}
		seen_est_arg = 1;
		return 0;
	default:
		return -1;
	}
}

static int opt_cb(int val, const char *optarg, int remote)
{
	if (remote)
		return 0; /* checked where the user typed it */
	return check_value(val, optarg);
}

static struct spank_option options[] = {
	{ "colloc", "SUMMARY",
	  "Share a GPU with other jobs (slurm-colloc, NVIDIA MPS). GPU memory is "
	  "estimated from the model summary file SUMMARY (torchinfo, torchsummary or "
	  "print(model) output); without SUMMARY or --colloc-mem the job gets a whole "
	  "GPU's worth of memory.", 2, OPT_COLLOC, opt_cb },
	{ "colloc-mem", "SIZE",
	  "GPU memory the job needs (e.g. 8G, 7500M; a plain number is MiB); "
	  "implies --colloc and skips estimation.", 1, OPT_MEM, opt_cb },
	{ "colloc-batch-size", "N",
	  "Training batch size, for the estimate (required with --colloc=SUMMARY).",
	  1, OPT_BATCH, opt_cb },
	{ "colloc-seq-len", "L", "Sequence length, for the estimate (transformers).",
	  1, OPT_SEQ, opt_cb },
	{ "colloc-optimizer", "NAME",
	  "Optimizer, for the estimate: sgd, momentum, adam or adamw (estimator default if omitted).",
	  1, OPT_OPTIMIZER, opt_cb },
	{ "colloc-precision", "NAME",
	  "Precision, for the estimate: fp32, amp-fp16 or amp-bf16 (estimator default if omitted).",
	  1, OPT_PRECISION, opt_cb },
	{ "colloc-attention", "IMPL",
	  "Attention implementation, for the estimate: eager, sdpa or flash (default: what "
	  "the summary shows, else eager).", 1, OPT_ATTENTION, opt_cb },
	SPANK_OPTIONS_TABLE_END
};

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();
	struct spank_option *o;

	(void)ac;
	(void)av;
	if (ctx != S_CTX_ALLOCATOR && ctx != S_CTX_LOCAL && ctx != S_CTX_REMOTE)
		return 0;
	for (o = options; o->name; o++) {
		spank_err_t rc = spank_option_register(sp, o);
		if (rc != ESPANK_SUCCESS) {
			slurm_error(LOG_PREFIX "cannot register --%s: %s", o->name,
				    spank_strerror(rc));
			return -1;
		}
	}
	return 0;
}

/* After all options are parsed (sbatch/salloc/srun): check how they combine. */
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();

	(void)sp;
	(void)ac;
	(void)av;
	if (ctx != S_CTX_ALLOCATOR && ctx != S_CTX_LOCAL)
		return 0;
	if (seen_est_arg && !seen_summary && !seen_mem) {
		slurm_error(LOG_PREFIX "--colloc-batch-size/--colloc-seq-len/--colloc-optimizer/"
			    "--colloc-precision need --colloc=SUMMARY");
		return -1;
	}
	if (seen_summary && !seen_mem && !seen_batch) {
		slurm_error(LOG_PREFIX "--colloc=SUMMARY needs --colloc-batch-size=N "
			    "(or give the memory with --colloc-mem=SIZE)");
		return -1;
	}
	(void)seen_colloc;
	return 0;
}

#endif /* COLLOC_SIZE_PARSER_ONLY */
