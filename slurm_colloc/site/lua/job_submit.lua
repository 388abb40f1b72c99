--[[
job_submit.lua of slurm-colloc: runs inside slurmctld for every submission.

Pure Lua 5.1: no process spawns, no file reads, a few string operations per job.
Site constants are written into the COLLOC table below by `colloc admin install`.

What it does for a job that asked for --colloc (SPANK option present in
job_desc.spank_job_env as _SLURM_SPANK_OPTION_colloc_<opt>=VALUE):
  1. rejects contradictions: --gres=gpu / --gpus* / --gres=shard together with
     --colloc, more than one node, a malformed estimate or size, a need larger
     than one GPU;
  2. works out the GPU memory the job needs (MiB):
       mode=explicit  --colloc-mem=SIZE
       mode=estimate  the record cli_filter.lua put at the start of the comment
                      ("colloc-estimate:v1:mib=N,margin=M,est=NAME,fp=HEX"),
                      need = mib (the estimator's figure already includes its
                      margin M, reported for the record); checked here, never
                      trusted blindly
       mode=default   neither (cli_filter bypassed, or bare --colloc): the site
                      default (default_colloc_mib; 0 = a whole GPU), with a message
  3. turns it into gres/shard on one GPU: shards = ceil(need / shard_mib), added
     to TresPerNode as gres:shard:K (Slurm then never promises a GPU more memory
     than it has, because each GPU offers only gpu_memory_mib // shard_mib shards);
  4. strips the estimate record from the comment (the user's own comment stays)
     and records the decision in AdminComment:
       colloc1:mode=M,need_mib=N,shards=K,shard_mib=S,alloc_mib=K*S
              [,est=NAME,est_mib=E,margin_mib=G,fp=HEX][,why=REASON]
     only [a-z0-9._=,:-] characters (safe under slurmdbd's lowercasing).
A job that asks for gres/shard without --colloc gets mode=shards, so the node
scripts limit its memory to what it asked for (shards must fit one GPU).

Whole GPUs next to shards: Slurm 22.05 does not keep gres/gpu and gres/shard apart
(seen on the devcluster: a --gres=gpu:1 job was given GPU 0 while three shard jobs ran
on it). So a one-GPU request (--gres=gpu:1, --gpus=1, --gpus-per-node=1) becomes all
the shards of one GPU (mode=whole: the node scripts run it without MPS), and a job
asking for more than one GPU per node gets its nodes exclusively (no shared job can
land on its GPUs).

Users may change colloc jobs only through root/SlurmUser (slurm_job_modify).
--]]

local COLLOC = {
-- @@COLLOC_SETTINGS@@ (replaced at install time)
	shard_mib = 1024,
	gpu_memory_mib = 40960,
	default_colloc_mib = 0,
	trusted_uids = { [0] = true },
}

local SPANK_PREFIX = "_SLURM_SPANK_OPTION_colloc_"
local EST_PREFIX = "colloc-estimate:"
local RECORD_PREFIX = "colloc1:"
local NO_VAL = 4294967294
local MAX_MIB = 16 * 1024 * 1024
local MAX_ENV = 512

-- Error codes (slurm_errno.h); Slurm 22.05 exports only a few to Lua.
local E_GRES = slurm.ESLURM_INVALID_GRES or 2072
local E_NODES = slurm.ESLURM_INVALID_NODE_COUNT or 2006
local E_ACCESS = slurm.ESLURM_ACCESS_DENIED or 2002

local function reject(code, fmt, ...)
	local msg = string.format(fmt, ...)
	slurm.log_user("colloc: " .. msg)
	slurm.log_info("colloc: job_submit: rejected: %s", msg)
	return code
end

-- SIZE grammar shared with the SPANK plugin: number + optional K/M/G/T[i][B]; bare = MiB.
local UNITS = { k = 1 / 1024, m = 1, g = 1024, t = 1024 * 1024 }
local function parse_size_mib(s)
	if type(s) ~= "string" or #s > 32 then return nil end
	local num, unit, rest = string.match(s, "^(%d+%.?%d*)([kKmMgGtT]?)(.*)$")
	if not num then return nil end
	if rest ~= "" and not (unit ~= "" and string.match(rest, "^[iI]?[bB]?$")) then
		return nil
	end
	local v = tonumber(num)
	if not v or v <= 0 then return nil end
	v = v * (UNITS[string.lower(unit)] or 1)
	if v > MAX_MIB then return nil end
	local mib = math.ceil(v)
	if mib < 1 then mib = 1 end
	return mib
end

-- The colloc SPANK options of the job: option name (dashes as underscores) -> value.
local function colloc_options(job_desc)
	local env = job_desc.spank_job_env
	if type(env) ~= "table" then return nil end
	local opts, found = {}, false
	local n = #SPANK_PREFIX
	for i = 0, MAX_ENV do
		local entry = env[i]
		if entry == nil then break end
		if string.sub(entry, 1, n) == SPANK_PREFIX then
			local name, value = string.match(string.sub(entry, n + 1), "^([%w_]+)=(.*)$")
			if name then
				if value == "(null)" then value = "" end
				opts[name] = value
				found = true
			end
		end
	end
	if found then return opts end
	return nil
end

local function has_gpu_request(s)
	return type(s) == "string" and string.find(s, "gpu", 1, true) ~= nil
end

-- Shard count of a TresPerNode string ("gres:shard:5", "gres/shard:5"), or nil.
local function shard_request(s)
	if type(s) ~= "string" then return nil end
	local k = string.match(s, "gres[:/]shard:(%d+)")
	if k then return tonumber(k) end
	if string.match(s, "gres[:/]shard$") or string.match(s, "gres[:/]shard,") then return 1 end
	return nil
end

-- Parse "colloc-estimate:v1:..." at the start of the comment.
-- Returns (estimate table | nil, rest of the comment, error message | nil).
local function take_estimate(comment)
	if type(comment) ~= "string" or string.sub(comment, 1, #EST_PREFIX) ~= EST_PREFIX then
		return nil, comment, nil
	end
	local record, rest = string.match(comment, "^(%S+)%s?(.*)$")
	local body = string.match(record, "^colloc%-estimate:v1:(.+)$")
	if not body then
		return nil, rest, "unknown estimate record version (expected colloc-estimate:v1:...)"
	end
	local fields = {}
	for k, v in string.gmatch(body, "([%w_]+)=([^,]*)") do fields[k] = v end
	local e = {
		mib = tonumber(string.match(fields.mib or "", "^%d+$") or ""),
		margin = tonumber(string.match(fields.margin or "", "^%d+$") or ""),
		est = string.match(fields.est or "", "^[a-z0-9._-]+$"),
		fp = string.match(string.lower(fields.fp or ""), "^[0-9a-f]+$"),
	}
	if not e.mib or e.mib < 1 or e.mib > MAX_MIB then
		return nil, rest, "estimate mib=" .. tostring(fields.mib) .. " is not a positive MiB count"
	end
	if not e.margin or e.margin > e.mib then
		return nil, rest, "estimate margin=" .. tostring(fields.margin)
			.. " is not a MiB count within mib=" .. tostring(fields.mib)
	end
	if not e.est or #e.est > 32 then
		return nil, rest, "estimator name est=" .. tostring(fields.est) .. " is not [a-z0-9._-]{1,32}"
	end
	if not e.fp or #e.fp > 64 then
		return nil, rest, "fingerprint fp=" .. tostring(fields.fp) .. " is not 1-64 hex digits"
	end
	return e, rest, nil
end

local function shards_per_gpu()
	return math.floor(COLLOC.gpu_memory_mib / COLLOC.shard_mib)
end

local function add_shards(tres, k)
	local piece = "gres:shard:" .. k
	if type(tres) == "string" and tres ~= "" then return tres .. "," .. piece end
	return piece
end

local function colloc_submit(job_desc, opts, submit_uid)
	for _, f in ipairs({ "tres_per_node", "tres_per_job", "tres_per_socket", "tres_per_task" }) do
		if has_gpu_request(job_desc[f]) then
			return reject(E_GRES, "--colloc cannot be combined with --gres=gpu or --gpus*: "
				.. "a --colloc job gets a share of one GPU (drop the GPU request, or drop --colloc "
				.. "to get whole GPUs)")
		end
	end
	if shard_request(job_desc.tres_per_node) then
		return reject(E_GRES, "--colloc cannot be combined with --gres=shard: give the memory "
			.. "with --colloc-mem=SIZE instead")
	end
	local min_nodes = job_desc.min_nodes
	if min_nodes ~= nil and min_nodes ~= NO_VAL and min_nodes > 1 then
		return reject(E_NODES, "--colloc jobs run on one GPU of one node; %d nodes requested",
			min_nodes)
	end

	local spg = shards_per_gpu()
	local gpu_cap = spg * COLLOC.shard_mib
	local mode, need, why, est
	local comment_est, rest, err = take_estimate(job_desc.comment)
	if opts.colloc_mem ~= nil then
		need = parse_size_mib(opts.colloc_mem)
		if not need then
			return reject(E_GRES, "--colloc-mem=%s: expected a size such as 8G, 7500M or 7500 (MiB)",
				string.sub(opts.colloc_mem, 1, 40))
		end
		mode = "explicit"
	elseif err then
		return reject(E_GRES, "malformed memory estimate in the job's comment: %s "
			.. "(resubmit with sbatch --colloc=SUMMARY, or give --colloc-mem=SIZE)", err)
	elseif comment_est then
		mode, est = "estimate", comment_est
		need = est.mib
	else
		mode = "default"
		if COLLOC.default_colloc_mib > 0 then
			need = math.min(COLLOC.default_colloc_mib, gpu_cap)
		else
			need = gpu_cap
		end
		if opts.colloc ~= nil and opts.colloc ~= "" then why = "no-estimate" else why = "no-size" end
	end
	if need > gpu_cap then
		local src = "estimated"
		if mode == "explicit" then src = "requested" end
		return reject(E_GRES, "the job needs %d MiB of GPU memory (%s) but one GPU offers at most "
			.. "%d MiB (%d shards of %d MiB); --colloc jobs run on one GPU. Reduce the batch size, "
			.. "or submit without --colloc for multi-GPU training", need, src, gpu_cap, spg,
			COLLOC.shard_mib)
	end
	local shards = math.ceil(need / COLLOC.shard_mib)
	if shards < 1 then shards = 1 end

	job_desc.tres_per_node = add_shards(job_desc.tres_per_node, shards)
	if min_nodes == nil or min_nodes == NO_VAL then job_desc.min_nodes = 1 end
	job_desc.max_nodes = 1
	if comment_est or err then job_desc.comment = rest or "" end

	local rec = string.format("%smode=%s,need_mib=%d,shards=%d,shard_mib=%d,alloc_mib=%d",
		RECORD_PREFIX, mode, need, shards, COLLOC.shard_mib, shards * COLLOC.shard_mib)
	if est then
		rec = rec .. string.format(",est=%s,est_mib=%d,margin_mib=%d,fp=%s",
			est.est, est.mib, est.margin, est.fp)
	end
	if why then rec = rec .. ",why=" .. why end
	job_desc.admin_comment = rec
	if mode == "default" then
		slurm.log_user(string.format("colloc: no GPU memory estimate came with this job (%s); "
			.. "it gets %d MiB (%d shards%s). Use sbatch --colloc=SUMMARY "
			.. "--colloc-batch-size=N or --colloc-mem=SIZE to share a GPU.",
			why == "no-estimate" and "was the cli_filter bypassed?" or "no summary or size given",
			shards * COLLOC.shard_mib, shards,
			shards == spg and ", a whole GPU" or ""))
	end
	slurm.log_info("colloc: job_submit: uid %s: %s", tostring(submit_uid), rec)
	return slurm.SUCCESS
end

local function plain_shard_submit(job_desc, k, submit_uid)
	local spg = shards_per_gpu()
	if k > spg then
		return reject(E_GRES, "gres/shard:%d does not fit one GPU (%d shards of %d MiB each); "
			.. "shards are GPU memory and a job's shards come from one GPU", k, spg,
			COLLOC.shard_mib)
	end
	local rec = string.format("%smode=shards,need_mib=%d,shards=%d,shard_mib=%d,alloc_mib=%d",
		RECORD_PREFIX, k * COLLOC.shard_mib, k, COLLOC.shard_mib, k * COLLOC.shard_mib)
	job_desc.admin_comment = rec
	slurm.log_info("colloc: job_submit: uid %s: %s", tostring(submit_uid), rec)
	return slurm.SUCCESS
end

-- Whole GPUs asked for per node: (count, field) for "gres:gpu:N" / "gres:gpu:TYPE:N"
-- in tres_per_node, or in tres_per_job of a one-node job; nil when no GPU is asked.
local function gpu_request(job_desc)
	for _, f in ipairs({ "tres_per_node", "tres_per_job" }) do
		local s = job_desc[f]
		if type(s) == "string" then
			local n = string.match(s, "gres[:/]gpu:(%d+)$") or string.match(s, "gres[:/]gpu:(%d+),")
				or string.match(s, "gres[:/]gpu:[^:,]+:(%d+)")
			if n then return tonumber(n), f end
			if string.match(s, "gres[:/]gpu$") or string.match(s, "gres[:/]gpu,") then
				return 1, f
			end
		end
	end
	return nil, nil
end

local function whole_gpu_submit(job_desc, n, field, submit_uid)
	local min_nodes = job_desc.min_nodes
	local one_node = min_nodes == nil or min_nodes == NO_VAL or min_nodes <= 1
	if n == 1 and (field == "tres_per_node" or one_node) and not has_gpu_request(job_desc.tres_per_task)
		and not has_gpu_request(job_desc.tres_per_socket) then
		local spg = shards_per_gpu()
		local other = job_desc.tres_per_node
		if field == "tres_per_node" then
			other = nil
		else
			job_desc[field] = "" -- Slurm's Lua setters take strings, not nil
		end
		job_desc.tres_per_node = add_shards(other, spg)
		local rec = string.format("%smode=whole,need_mib=%d,shards=%d,shard_mib=%d,alloc_mib=%d",
			RECORD_PREFIX, spg * COLLOC.shard_mib, spg, COLLOC.shard_mib, spg * COLLOC.shard_mib)
		job_desc.admin_comment = rec
		slurm.log_info("colloc: job_submit: uid %s: one whole GPU as %d shards: %s",
			tostring(submit_uid), spg, rec)
		return slurm.SUCCESS
	end
	-- several GPUs per node: Slurm 22.05 could put shard jobs on them; take the nodes whole
	job_desc.shared = 0
	slurm.log_info("colloc: job_submit: uid %s: %d GPUs per node: nodes given exclusively",
		tostring(submit_uid), n)
	return slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	local opts = colloc_options(job_desc)
	if opts ~= nil then
		return colloc_submit(job_desc, opts, submit_uid)
	end
	-- Not a --colloc job (an estimate record in its comment means nothing then).
	local k = shard_request(job_desc.tres_per_node)
	if k ~= nil then
		return plain_shard_submit(job_desc, k, submit_uid)
	end
	local n, field = gpu_request(job_desc)
	if n ~= nil and n > 0 then
		return whole_gpu_submit(job_desc, n, field, submit_uid)
	end
	return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	if COLLOC.trusted_uids[modify_uid] then return slurm.SUCCESS end
	local ac = job_rec.admin_comment
	if type(ac) ~= "string" or string.sub(ac, 1, #RECORD_PREFIX) ~= RECORD_PREFIX then
		return slurm.SUCCESS
	end
	for _, f in ipairs({ "tres_per_node", "tres_per_job", "tres_per_socket", "tres_per_task" }) do
		if job_desc[f] ~= nil then
			return reject(E_ACCESS, "job %s is a --colloc job: its GPU share is fixed at "
				.. "submission; cancel it and resubmit with another --colloc-mem or summary",
				tostring(job_rec.job_id))
		end
	end
	local n = job_desc.min_nodes
	if n ~= nil and n ~= NO_VAL and n > 1 then
		return reject(E_NODES, "job %s is a --colloc job and runs on one node",
			tostring(job_rec.job_id))
	end
	return slurm.SUCCESS
end

slurm.log_info("colloc: job_submit.lua loaded (shard_mib=%d, gpu_memory_mib=%d)",
	COLLOC.shard_mib, COLLOC.gpu_memory_mib)
return slurm.SUCCESS
