--[[
job_submit.lua of slurm-colloc: runs inside slurmctld for every submission.

Pure Lua 5.1: no process spawns, no file reads, a few string operations per job.
Site constants are written into the COLLOC table below by `colloc admin install`.

Scope (COLLOC.shared_partitions, from colloc.conf's shared_partitions):
  empty (the default): opt-in per job. Only --colloc jobs and plain --gres=shard jobs
    are handled; every other job, GPU jobs included, is left exactly as submitted.
  listed: the partitions whose nodes offer shards (each with its own GPU size,
    COLLOC.partition_gpu_mib). A --colloc job without a partition goes to every
    listed one whose GPU can hold it, in the listed order (Slurm takes the first with
    room; a default-size job gets a whole GPU of the smallest); one naming
    partitions is narrowed to the listed ones among them whose GPU can hold it, and
    refused if none is listed. Its need is checked against the largest GPU among them. Whole-GPU jobs are handled only
    when they would run in a listed partition (below); jobs in other partitions are
    never touched. A job without a partition runs in Slurm's default partition, found
    in part_list (flag_default); unknown = not listed.
Chaining: Slurm loads one job_submit.lua. `colloc admin install --chain-job-submit
PATH` embeds the site's own script below (SITE_CHAIN); it is loaded once with this
file, and its slurm_job_submit/slurm_job_modify run first: a refusal of theirs is the
answer, otherwise colloc's logic runs on the job as they left it.

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
     to TresPerNode as gres/shard:K (Slurm then never promises a GPU more memory
     than it has, because each GPU offers only gpu_memory_mib // shard_mib shards;
     24.11+ refuses the 22.05 spelling gres:shard:K, see add_shards); with compute
     admission on (sm_capacity_pct > 0), at least ceil(sm / sm_capacity_pct * S)
     shards of a GPU of S shards, sm being the job's expected SM activity: the
     user's own measured runs of the model (compute_history_file, uid + fp, written
     by root's `colloc admin compute-history --write`), else sm_prior_pct; so a GPU's
     shards bound its expected compute as well as its memory;
  4. strips the estimate record from the comment (the user's own comment stays)
     and records the decision in AdminComment:
       colloc1:mode=M,need_mib=N,shards=K,shard_mib=S,alloc_mib=K*S
              [,est=NAME,est_mib=E,margin_mib=G,fp=HEX]
              [,sm_pct=P,sm_src=history|prior,mem_shards=KM][,why=REASON]
     only [a-z0-9._=,:-] characters (safe under slurmdbd's lowercasing).
A job that asks for gres/shard without --colloc gets mode=shards, so the node
scripts limit its memory to what it asked for (shards, typed or not, must be asked
per node in one entry and fit one GPU).

Whole GPUs next to shards: Slurm 22.05 did not keep gres/gpu and gres/shard apart (seen
on the devcluster: a --gres=gpu:1 job was given GPU 0 while three shard jobs ran on it).
23.11 fixed that, and 24.11.5 and 26.05.5 were seen keeping them apart on the devcluster
(tests/e2e/test_gpu_shard_overlap.py, docs/job-submit.md): a gres/gpu job is given only
GPUs that no shard job holds and waits while there are too few, and no shard job goes to
a GPU a gres/gpu job holds. So a job that may hold more than one GPU of a node (several
GPUs, --gpus on several nodes, --gpus-per-task, --gpus-per-socket) is left as submitted:
it keeps its gres/gpu and shares its nodes, never its GPUs, with shard jobs (nothing is
squeezed onto one GPU; until 22.05 was dropped it took its nodes exclusively). So is a
one-GPU job whose partitions mix listed and other partitions, or listed ones of
different GPU sizes (no single shard count is one GPU everywhere it may run). In a
listed partition a one-GPU request (--gres=gpu:1, --gres=gpu:TYPE[:1], --gpus=1 on one
node, --gpus-per-node=1) still becomes all the shards of one GPU of that partition
(mode=whole; the job's other gres stay): no longer to keep it off shared GPUs, but so
that it is recorded (AdminComment, accounting) and known to the epilog and colloc-report
as colloc's whole-GPU job. A job asking for whole GPUs and shards together is refused.

All GPU requests are read from every TRES field (tres_per_node/job/socket/task), gres
entries "gres/NAME[:TYPE][:COUNT]" (how Slurm 24.11+ hands a user's --gres=gpu:1 or
--gpus=1 to this script: "gres/gpu:1") and the older "gres:NAME[:TYPE][:COUNT]" (a
site's chained script, an old habit); an entry naming gpu or shard that cannot be read
is refused, never ignored (outside the job's scope only when it names shard). What this
script writes is always "gres/..." (24.11+ refuses "gres:..." from a job_submit.lua).

AdminComment belongs to this script: whatever a submitter put there is cleared
(root/SlurmUser may keep a note of their own that is not a colloc record); the record is
written only from values computed or validated here.

slurm_job_modify: root/SlurmUser (the epilog's requeue raising shards and rewriting the
record) pass. Users may not change the GPU request of a recorded job, nor add shard
requests to any job, nor gpu requests to a job that may run in a listed partition, by
`scontrol update` (a user's update cannot carry the record, AdminComment being
admin-only in Slurm, so it cannot be normalised the way a submission is, and a new
gpu:1 would skip the whole-GPU conversion: cancel and resubmit), nor move a recorded job, or a GPU job into a listed
partition, to other partitions, nor write a colloc record into AdminComment.

Messages: slurm.log_* take a printf FORMAT (22.05: string.format(unpack({...}))), so
text that may hold user data is always passed as an argument ("%s").
--]]

local COLLOC = {
-- @@COLLOC_SETTINGS@@ (replaced at install time)
	shard_mib = 1024,
	gpu_memory_mib = 40960,
	default_colloc_mib = 0,
	trusted_uids = { [0] = true },
	shared_partitions = {},
	partition_gpu_mib = {},
	sm_capacity_pct = 0,
	sm_prior_pct = 0,
	compute_history_file = "",
}

-- The site's own job_submit.lua, embedded by `colloc admin install --chain-job-submit`.
local SITE_CHAIN = nil
-- @@SITE_CHAIN@@

-- Loaded once, with this file: the site's globals stay its own; its two entry points
-- are kept here and the globals given back to colloc's (defined at the end).
local site_submit, site_modify
if SITE_CHAIN ~= nil then
	-- loadstring is Lua 5.1's; from 5.2 load takes a string (EL9's Slurm links Lua 5.4)
	local chunk, err = (loadstring or load)(SITE_CHAIN.text, "=" .. SITE_CHAIN.name)
	if chunk then
		local ok, lerr = pcall(chunk)
		if not ok then chunk, err = nil, lerr end
	end
	if chunk and type(slurm_job_submit) == "function" then
		site_submit = slurm_job_submit
		if type(slurm_job_modify) == "function" then site_modify = slurm_job_modify end
	else
		slurm.log_error("colloc: the chained job_submit.lua %s did not load: %s; every "
			.. "submission is refused", SITE_CHAIN.name,
			tostring(err or "it defines no slurm_job_submit"))
	end
	slurm_job_submit, slurm_job_modify = nil, nil
end

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
local E_PART = slurm.ESLURM_INVALID_PARTITION_NAME or 2000

local E_MAX_RECORD = 256 -- longest colloc-estimate record accepted from the comment

-- fmt is a constant of this file; user data only ever travels in the arguments.
local function reject(code, fmt, ...)
	local msg = string.format(fmt, ...)
	slurm.log_user("%s", "colloc: " .. msg)
	slurm.log_info("colloc: job_submit: rejected: %s", msg)
	return code
end

local function starts_with(s, prefix)
	return type(s) == "string" and string.sub(s, 1, #prefix) == prefix
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

local TRES_FIELDS = { "tres_per_node", "tres_per_job", "tres_per_socket", "tres_per_task" }
local MAX_TRES = 1024
-- Slurm reads gres counts with an optional k/m/g suffix (x1024 each).
local COUNT_MULT = { [""] = 1, k = 1024, m = 1024 * 1024, g = 1024 * 1024 * 1024 }

local function gres_count(tok)
	local d, suffix = string.match(tok, "^(%d+)([kKmMgG]?)$")
	if not d or #d > 9 then return nil end
	return tonumber(d) * COUNT_MULT[string.lower(suffix)]
end

-- The gpu and shard entries of one TRES string.
-- Returns a table { gpu = {entries}, shard = {entries}, other = {raw entries} } with
-- entries { count = N, type = TYPE|nil, raw = TEXT }, or (nil, error message).
local function gres_entries(s)
	local r = { gpu = {}, shard = {}, other = {} }
	if s == nil or s == "" then return r end
	if type(s) ~= "string" or #s > MAX_TRES then return nil, "unreadable TRES request" end
	for raw in string.gmatch(s, "[^,]+") do
		local body = string.match(raw, "^[gG][rR][eE][sS][:/](.*)$") or raw
		local parts = {}
		for p in string.gmatch(body, "[^:=]+") do parts[#parts + 1] = p end
		local name = string.lower(parts[1] or "")
		if name == "gpu" or name == "shard" then
			local e = { raw = raw }
			if #parts == 1 then
				e.count = 1
			elseif #parts == 2 then
				e.count = gres_count(parts[2])
				if not e.count then e.type, e.count = parts[2], 1 end
			elseif #parts == 3 then
				e.type, e.count = parts[2], gres_count(parts[3])
			end
			if not e.count or (e.type and not string.match(e.type, "^[%w._-]+$")) then
				return nil, "cannot read the request " .. raw
			end
			table.insert(r[name], e)
		else
			local lraw = string.lower(raw)
			if (string.find(lraw, "gpu", 1, true) or string.find(lraw, "shard", 1, true))
				and not string.match(name, "^[%w._-]+$") then
				-- not an entry we understand, but it speaks of GPUs: refuse, never ignore
				return nil, "cannot read the request " .. raw
			end
			r.other[#r.other + 1] = raw
		end
	end
	return r
end

local function total(entries)
	local n = 0
	for _, e in ipairs(entries) do n = n + e.count end
	return n
end

-- GPU and shard requests over all TRES fields of a job_desc:
--   { [field] = gres_entries(...), gpus = N (all fields), shards = N,
--     gpu_fields = { field = N }, shard_fields = { field = N }, mentions_gpu/shard }
-- or (nil, error message).
local function gres_request(job_desc)
	local req = { gpus = 0, shards = 0, gpu_fields = {}, shard_fields = {} }
	for _, f in ipairs(TRES_FIELDS) do
		local r, err = gres_entries(job_desc[f])
		if not r then return nil, f .. ": " .. err end
		req[f] = r
		if #r.gpu > 0 then
			req.mentions_gpu = true
			req.gpu_fields[f] = total(r.gpu)
			req.gpus = req.gpus + req.gpu_fields[f]
		end
		if #r.shard > 0 then
			req.mentions_shard = true
			req.shard_fields[f] = total(r.shard)
			req.shards = req.shards + req.shard_fields[f]
		end
	end
	return req
end

-- Parse "colloc-estimate:v1:..." at the start of the comment: exactly the keys mib,
-- margin, est, fp, each once. The comment is the user's: every value is checked here
-- and only validated values go into the record.
-- Returns (estimate table | nil, rest of the comment, error message | nil).
local EST_KEYS = { mib = true, margin = true, est = true, fp = true }
local function take_estimate(comment)
	if type(comment) ~= "string" or string.sub(comment, 1, #EST_PREFIX) ~= EST_PREFIX then
		return nil, comment, nil
	end
	local record, rest = string.match(comment, "^(%S+)%s?(.*)$")
	if #record > E_MAX_RECORD then
		return nil, rest, "estimate record longer than " .. E_MAX_RECORD .. " characters"
	end
	local body = string.match(record, "^colloc%-estimate:v1:(.+)$")
	if not body then
		return nil, rest, "unknown estimate record version (expected colloc-estimate:v1:...)"
	end
	local fields = {}
	for pair in string.gmatch(body .. ",", "([^,]*),") do
		local k, v = string.match(pair, "^([%w_]+)=([^=]*)$")
		if not k then
			return nil, rest, "estimate field '" .. pair .. "' is not KEY=VALUE"
		end
		if not EST_KEYS[k] then return nil, rest, "unknown estimate field " .. k end
		if fields[k] then return nil, rest, "estimate field " .. k .. " given twice" end
		fields[k] = v
	end
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

local function shards_of(mib)
	return math.floor(mib / COLLOC.shard_mib)
end

-- Slurm 24.11+ reads a TRES request as TYPE/NAME[:TYPE]:COUNT ("gres/shard:4"); a
-- job_submit.lua that writes the 22.05 spelling "gres:shard:4" has the job refused
-- ("Invalid Trackable RESource (TRES) specification"). So every gres entry this script
-- writes back, its own and the job's others it keeps, is in the slash form.
local function slash_form(entry)
	local body = string.match(entry, "^[gG][rR][eE][sS][:/](.*)$")
	if body then return "gres/" .. body end
	return entry
end

-- entries (strings) -> one TRES string in the slash form ("" for none).
local function tres_join(entries)
	local out = {}
	for _, raw in ipairs(entries) do out[#out + 1] = slash_form(raw) end
	return table.concat(out, ",")
end

-- The job's TRES string with K shards added (one GPU's worth at most, checked before).
local function add_shards(tres, k)
	local entries = {}
	if type(tres) == "string" then
		for raw in string.gmatch(tres, "[^,]+") do entries[#entries + 1] = raw end
	end
	entries[#entries + 1] = "gres/shard:" .. k
	return tres_join(entries)
end

local function is_trusted(uid)
	return COLLOC.trusted_uids[tonumber(uid)] == true
end

-- ------------------------------------------------------------------ partitions
local MAX_PARTS = 64

local function sharing()
	return #COLLOC.shared_partitions > 0
end

-- "a,b" -> { "a", "b" } (nil or "" -> {}).
local function split_list(s)
	local out = {}
	if type(s) ~= "string" then return out end
	for name in string.gmatch(s, "[^,%s]+") do
		if #out >= MAX_PARTS then break end
		out[#out + 1] = name
	end
	return out
end

-- Slurm's default partition among those the user may use (22.05: part_list is a table
-- of partition records keyed by name, each with name and flag_default); nil if unknown.
local function default_partition(part_list)
	if type(part_list) ~= "table" then return nil end
	for key, part in pairs(part_list) do
		if type(part) == "table" or type(part) == "userdata" then
			local flag = part.flag_default
			if flag == 1 or flag == true then
				local name = part.name
				if type(name) ~= "string" then name = key end
				if type(name) == "string" and name ~= "" then return name end
			end
		end
	end
	return nil
end

-- The partitions a job will run in: its own list, else Slurm's default (if known).
local function job_partitions(partition, part_list)
	local names = split_list(partition)
	if #names > 0 then return names, true end
	local d = default_partition(part_list)
	if d then return { d }, false end
	return {}, false
end

-- The listed partitions among names, with the smallest and largest usable GPU (MiB).
local function shared_among(names)
	local out, lo, hi = {}, nil, nil
	for _, name in ipairs(names) do
		local mib = COLLOC.partition_gpu_mib[name]
		if mib then
			out[#out + 1] = name
			if not lo or mib < lo then lo = mib end
			if not hi or mib > hi then hi = mib end
		end
	end
	return out, lo, hi
end

local function shared_names()
	return table.concat(COLLOC.shared_partitions, ",")
end

-- Nobody but this script writes AdminComment at submission: clear what the submitter
-- gave (root/SlurmUser may keep a note of their own that is not a colloc record).
local function scrub_admin_comment(job_desc, submit_uid)
	local ac = job_desc.admin_comment
	if ac == nil then return end
	if is_trusted(submit_uid) and not starts_with(string.lower(ac), "colloc") then return end
	job_desc.admin_comment = "" -- Slurm's setter turns "" into NULL
	slurm.log_info("colloc: job_submit: uid %s: AdminComment given at submission dropped",
		tostring(submit_uid))
end

-- Where a --colloc job may run: (listed partitions, usable MiB of the largest GPU among
-- them, of the GPU a default-size job gets, first_fit) or (nil, error code) after
-- refusing it. first_fit: no partition given; the job goes to every listed partition
-- whose GPU holds it (Slurm takes the first with room).
local function colloc_target(job_desc)
	if not sharing() then
		return {}, COLLOC.gpu_memory_mib, COLLOC.gpu_memory_mib, false
	end
	local names = split_list(job_desc.partition)
	if #names == 0 then
		local _, _, hi = shared_among(COLLOC.shared_partitions)
		local first = COLLOC.partition_gpu_mib[COLLOC.shared_partitions[1]]
		return COLLOC.shared_partitions, hi, first, true
	end
	local shared, lo, hi = shared_among(names)
	if #shared == 0 then
		return nil, reject(E_PART, "--colloc jobs run in the partitions with shared GPUs (%s); "
			.. "this job asked for %s. Submit with -p %s (or without -p), or drop --colloc",
			shared_names(), string.sub(job_desc.partition, 1, 200), COLLOC.shared_partitions[1])
	end
	return shared, hi, lo, false
end

-- Compute admission: expected SM activity per (uid, fingerprint), from the root-owned
-- table `colloc admin compute-history --write` keeps (lines "UID FP SM_PCT"). Read at
-- most once a minute; a missing file or a bad line costs only that entry (the prior).
local COMPUTE_RELOAD_S = 60
local COMPUTE_MAX_LINES = 200000
local compute = { at = nil, sm = {} }

local function load_compute_table()
	local now = os.time()
	if compute.at ~= nil and now - compute.at < COMPUTE_RELOAD_S then return compute.sm end
	compute.at, compute.sm = now, {}
	if COLLOC.compute_history_file == "" then return compute.sm end
	local f = io.open(COLLOC.compute_history_file, "r")
	if not f then
		slurm.log_info("colloc: job_submit: no compute history at %s (prior only)",
			COLLOC.compute_history_file)
		return compute.sm
	end
	local n = 0
	for line in f:lines() do
		n = n + 1
		if n > COMPUTE_MAX_LINES then break end
		local uid, fp, sm = string.match(line, "^(%d+) ([0-9a-f]+) (%d+)$")
		sm = tonumber(sm)
		if uid and #fp <= 64 and sm and sm >= 1 and sm <= 100 then
			compute.sm[uid .. " " .. fp] = sm
		end
	end
	f:close()
	return compute.sm
end

-- (expected SM %, where it came from) of a job, or (nil, nil) without admission.
local function expected_sm(submit_uid, fp)
	if COLLOC.sm_capacity_pct <= 0 then return nil, nil end
	if fp ~= nil then
		local sm = load_compute_table()[tostring(submit_uid) .. " " .. fp]
		if sm ~= nil then return sm, "history" end
	end
	if COLLOC.sm_prior_pct > 0 then return COLLOC.sm_prior_pct, "prior" end
	return nil, nil
end

-- Shards that stand for sm % of a GPU of spg shards under the capacity (at most spg).
local function compute_shards(sm, spg)
	return math.min(spg, math.ceil(sm * spg / COLLOC.sm_capacity_pct))
end

local function colloc_submit(job_desc, opts, req, submit_uid)
	if req.mentions_gpu then
		return reject(E_GRES, "--colloc cannot be combined with --gres=gpu or --gpus*: "
			.. "a --colloc job gets a share of one GPU (drop the GPU request, or drop --colloc "
			.. "to get whole GPUs)")
	end
	if req.mentions_shard then
		return reject(E_GRES, "--colloc cannot be combined with --gres=shard: give the memory "
			.. "with --colloc-mem=SIZE instead")
	end
	local min_nodes = job_desc.min_nodes
	if min_nodes ~= nil and min_nodes ~= NO_VAL and min_nodes > 1 then
		return reject(E_NODES, "--colloc jobs run on one GPU of one node; %d nodes requested",
			min_nodes)
	end
	local targets, big_mib, small_mib, first_fit = colloc_target(job_desc)
	if not targets then return big_mib end -- the error code

	local spg = shards_of(big_mib)
	local gpu_cap = spg * COLLOC.shard_mib
	local small_cap = shards_of(small_mib) * COLLOC.shard_mib
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
			.. "(resubmit with sbatch --colloc=SUMMARY, or give --colloc-mem=SIZE)",
			string.sub(err, 1, 200))
	elseif comment_est then
		mode, est = "estimate", comment_est
		need = est.mib
	else
		mode = "default"
		if COLLOC.default_colloc_mib > 0 then
			need = math.min(COLLOC.default_colloc_mib, small_cap)
		else
			need = small_cap
		end
		if opts.colloc ~= nil and opts.colloc ~= "" then why = "no-estimate" else why = "no-size" end
	end
	if need > gpu_cap then
		local src = "estimated"
		if mode == "explicit" then src = "requested" end
		local where = ""
		if sharing() then where = " in partition " .. table.concat(targets, ",") end
		return reject(E_GRES, "the job needs %d MiB of GPU memory (%s) but one GPU offers at most "
			.. "%d MiB (%d shards of %d MiB%s); --colloc jobs run on one GPU. Reduce the batch "
			.. "size, or submit without --colloc for multi-GPU training", need, src, gpu_cap, spg,
			COLLOC.shard_mib, where)
	end
	local shards = math.ceil(need / COLLOC.shard_mib)
	if shards < 1 then shards = 1 end
	local mem_shards = shards
	local sm, sm_src = expected_sm(submit_uid, est and est.fp)
	if sm ~= nil then shards = math.max(shards, compute_shards(sm, shards_of(small_mib))) end

	if sharing() then
		-- only the listed partitions whose GPU holds the job (at least the largest does)
		local fit = {}
		for _, name in ipairs(targets) do
			if shards_of(COLLOC.partition_gpu_mib[name]) >= shards then fit[#fit + 1] = name end
		end
		-- every listed partition that holds it, in the listed order: a job that ran out
		-- of memory on a small GPU may come back on a larger one where a small one is full
		local part = table.concat(fit, ",")
		if part ~= job_desc.partition then
			job_desc.partition = part
			slurm.log_info("colloc: job_submit: uid %s: --colloc job sent to partition %s",
				tostring(submit_uid), part)
		end
	end
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
	if sm ~= nil then
		rec = rec .. string.format(",sm_pct=%d,sm_src=%s,mem_shards=%d", sm, sm_src, mem_shards)
	end
	if why then rec = rec .. ",why=" .. why end
	job_desc.admin_comment = rec
	if mode == "default" then
		slurm.log_user("%s", string.format("colloc: no GPU memory estimate came with this job (%s); "
			.. "it gets %d MiB (%d shards%s). Use sbatch --colloc=SUMMARY "
			.. "--colloc-batch-size=N or --colloc-mem=SIZE to share a GPU.",
			why == "no-estimate" and "was the cli_filter bypassed?" or "no summary or size given",
			shards * COLLOC.shard_mib, shards,
			shards == shards_of(small_mib) and ", a whole GPU" or ""))
	end
	slurm.log_info("colloc: job_submit: uid %s: %s", tostring(submit_uid), rec)
	return slurm.SUCCESS
end

-- spg: shards of one GPU where the job may run (the largest listed GPU among them).
local function plain_shard_submit(job_desc, req, submit_uid, spg)
	for f, _ in pairs(req.shard_fields) do
		if f ~= "tres_per_node" then
			return reject(E_GRES, "shards are GPU memory of one GPU per node: ask for them with "
				.. "--gres=shard:N (not per job, task or socket)")
		end
	end
	local entries = req.tres_per_node.shard
	if #entries > 1 then
		return reject(E_GRES, "ask for shards once (--gres=shard:N), not in several entries")
	end
	local k = req.shards
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

-- A TRES string's entries other than gpu (only called when it asks for no shards).
local function without_gpus(r)
	return tres_join(r.other)
end

-- A GPU job left with its gres/gpu in a listed partition: Slurm (23.11+, seen on 24.11
-- and 26.05) never gives a GPU that shard jobs hold to a gres/gpu job, nor the other way
-- round, so the job shares its nodes, not its GPUs.
local function keep_gpus(submit_uid, why)
	slurm.log_info("colloc: job_submit: uid %s: %s: left as submitted (gres/gpu)",
		tostring(submit_uid), why)
	return slurm.SUCCESS
end

-- A GPU job that may run in a listed partition. names: its partitions; shared, lo, hi:
-- the listed ones among them and their smallest/largest usable GPU.
local function whole_gpu_submit(job_desc, req, submit_uid, names, shared, lo, hi)
	local min_nodes = job_desc.min_nodes
	local one_node = min_nodes == nil or min_nodes == NO_VAL or min_nodes <= 1
	local field, n = next(req.gpu_fields)
	local single = next(req.gpu_fields, field) == nil and n == 1 and #req[field].gpu == 1
	if not (single and (field == "tres_per_node" or (field == "tres_per_job" and one_node))) then
		-- May hold several GPUs of a node (several GPUs, --gpus over several nodes,
		-- --gpus-per-task, --gpus-per-socket): squeezing them onto one GPU would be
		-- wrong, and Slurm keeps shard jobs off their GPUs (no longer the node: 22.05
		-- put shard jobs on a gres/gpu job's GPUs, so such jobs took their nodes whole).
		return keep_gpus(submit_uid, string.format("%d GPUs (%s)", req.gpus, field))
	end
	if #shared < #names or lo ~= hi then
		-- one shard count cannot stand for one GPU in every partition it may run in
		return keep_gpus(submit_uid, "one GPU in partitions " .. table.concat(names, ",")
			.. " (not all shared, or GPUs of different sizes)")
	end
	local spg = shards_of(lo)
	if field == "tres_per_job" then
		job_desc.tres_per_job = without_gpus(req.tres_per_job) -- "" clears it
	end
	local keep = without_gpus(req.tres_per_node)
	job_desc.tres_per_node = add_shards(keep, spg)
	local rec = string.format("%smode=whole,need_mib=%d,shards=%d,shard_mib=%d,alloc_mib=%d",
		RECORD_PREFIX, spg * COLLOC.shard_mib, spg, COLLOC.shard_mib, spg * COLLOC.shard_mib)
	job_desc.admin_comment = rec
	slurm.log_info("colloc: job_submit: uid %s: one whole GPU as %d shards: %s",
		tostring(submit_uid), spg, rec)
	return slurm.SUCCESS
end

local function colloc_job_submit(job_desc, part_list, submit_uid)
	local opts = colloc_options(job_desc)
	local req, err = gres_request(job_desc)
	local names = job_partitions(job_desc.partition, part_list)
	local shared, lo, hi = shared_among(names)
	-- listed partitions: only jobs that may run in one of them; none listed: opt-in
	local in_scope = sharing() and #shared > 0
	if not req then
		if opts ~= nil or in_scope or string.find(string.lower(err), "shard", 1, true) then
			return reject(E_GRES, "%s (expected gres/NAME[:TYPE][:COUNT])", err)
		end
		return slurm.SUCCESS
	end
	if opts ~= nil then
		return colloc_submit(job_desc, opts, req, submit_uid)
	end
	-- Not a --colloc job (an estimate record in its comment means nothing then).
	if req.shards > 0 then
		if sharing() and not in_scope then return slurm.SUCCESS end -- never touched
		if req.gpus > 0 then
			return reject(E_GRES, "a job cannot ask for whole GPUs and shards together (%d GPUs, "
				.. "%d shards): ask for --gres=shard:N (GPU memory on one shared GPU) or for GPUs, "
				.. "not both", req.gpus, req.shards)
		end
		return plain_shard_submit(job_desc, req, submit_uid,
			shards_of(hi or COLLOC.gpu_memory_mib))
	end
	if req.gpus > 0 and in_scope then
		return whole_gpu_submit(job_desc, req, submit_uid, names, shared, lo, hi)
	end
	return slurm.SUCCESS
end

-- Changes by users (not root/SlurmUser). Slurm passes the requester's uid as the 4th
-- argument; job_desc holds only the fields the update sets (others nil / NO_VAL).
local function colloc_job_modify(job_desc, job_rec, part_list, modify_uid)
	local ac = job_rec.admin_comment
	local recorded = starts_with(ac, RECORD_PREFIX)
	local job = tostring(job_rec.job_id)
	if is_trusted(modify_uid) then
		if job_desc.admin_comment ~= nil or job_desc.tres_per_node ~= nil then
			slurm.log_info("colloc: job_modify: job %s changed by uid %s (trusted)", job,
				tostring(modify_uid))
		end
		return slurm.SUCCESS
	end
	local new_ac = job_desc.admin_comment
	if new_ac ~= nil and (recorded or starts_with(string.lower(new_ac), "colloc")) then
		return reject(E_ACCESS, "job %s: its AdminComment holds slurm-colloc's record; only "
			.. "root or SlurmUser may change it", job)
	end
	local mode = recorded and string.match(ac, "^colloc1:mode=([a-z]+)") or nil
	local colloc_job = mode == "estimate" or mode == "explicit" or mode == "default"
	-- where the job will run after this update (unknown: as if shared)
	local part = job_desc.partition
	if part == nil then part = job_rec.partition end
	local shared = shared_among(split_list(part))
	local may_share = sharing() and (#shared > 0 or #split_list(part) == 0)
	local changes = false
	for _, f in ipairs(TRES_FIELDS) do
		if job_desc[f] ~= nil then changes = true end
	end
	if changes then
		if colloc_job then
			return reject(E_ACCESS, "job %s is a --colloc job: its GPU share is fixed at "
				.. "submission; cancel it and resubmit with another --colloc-mem or summary", job)
		end
		local req, err = gres_request(job_desc)
		if recorded or not req or req.mentions_shard or (req.mentions_gpu and may_share) then
			return reject(E_ACCESS, "job %s: GPU and shard requests are fixed at submission on "
				.. "this cluster (slurm-colloc records them then%s); cancel the job and resubmit "
				.. "it with the new request", job, err and ": " .. err or "")
		end
	end
	if job_desc.partition ~= nil and sharing() then
		-- a recorded job's shards were sized for its partitions; a GPU job moved into a
		-- shared partition would skip the whole-GPU conversion
		local gpu_job = false
		for _, f in ipairs(TRES_FIELDS) do
			local r = gres_entries(job_rec[f])
			if r == nil or #r.gpu > 0 then gpu_job = true end
		end
		if recorded or (gpu_job and #shared > 0) then
			return reject(E_ACCESS, "job %s: the partition of a GPU job is fixed at submission "
				.. "on this cluster (partitions with shared GPUs: %s); cancel the job and resubmit "
				.. "it to the new partition", job, shared_names())
		end
	end
	local n = job_desc.min_nodes
	if colloc_job and n ~= nil and n ~= NO_VAL and n > 1 then
		return reject(E_NODES, "job %s is a --colloc job and runs on one node", job)
	end
	return slurm.SUCCESS
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	scrub_admin_comment(job_desc, submit_uid)
	if SITE_CHAIN ~= nil then
		if not site_submit then
			return reject(slurm.ERROR, "the site's job_submit.lua (run before colloc's) did not "
				.. "load; please tell the administrators")
		end
		local rc = site_submit(job_desc, part_list, submit_uid)
		if type(rc) == "number" and rc ~= slurm.SUCCESS then return rc end
	end
	return colloc_job_submit(job_desc, part_list, submit_uid)
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	if SITE_CHAIN ~= nil then
		if not site_submit then
			return reject(slurm.ERROR, "the site's job_submit.lua (run before colloc's) did not "
				.. "load; please tell the administrators")
		end
		if site_modify then
			local rc = site_modify(job_desc, job_rec, part_list, modify_uid)
			if type(rc) == "number" and rc ~= slurm.SUCCESS then return rc end
		end
	end
	return colloc_job_modify(job_desc, job_rec, part_list, modify_uid)
end

slurm.log_info("colloc: job_submit.lua loaded (shard_mib=%d, gpu_memory_mib=%d, shared "
	.. "partitions: %s%s)", COLLOC.shard_mib, COLLOC.gpu_memory_mib,
	sharing() and shared_names() or "none, opt-in per job",
	SITE_CHAIN ~= nil and "; chained after " .. SITE_CHAIN.name or "")
return slurm.SUCCESS
