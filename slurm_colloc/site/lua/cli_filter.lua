--[[
cli_filter.lua of slurm-colloc: runs inside the user's sbatch/salloc/srun, as the user.

For `--colloc=SUMMARY` (without --colloc-mem) it runs the estimator
  <estimator_command> estimate --summary SUMMARY --batch-size N [--seq-len L]
      [--optimizer NAME] [--precision NAME] --json
and puts its result at the start of the job's comment:
  colloc-estimate:v1:mib=N,margin=M,est=NAME,fp=HEX[ <the user's own comment>]
job_submit.lua checks that record, turns it into gres/shard and removes it from the
comment again. A bad or unreadable summary fails sbatch here with the estimator's
message. This filter is a convenience, not a security boundary: users can bypass it,
and job_submit.lua treats a job without a record as "no estimate" (safe default).

Site constants are written into the COLLOC table by `colloc admin install`.

Chaining: Slurm loads one cli_filter.lua. `colloc admin install --chain-cli-filter PATH`
embeds the site's own script below (SITE_CHAIN); it is loaded once with this file, and
its slurm_cli_setup_defaults/slurm_cli_pre_submit/slurm_cli_post_submit run first: a
non-success return of theirs is the answer, otherwise colloc's runs on the options as
they left them. A site script that does not load fails every command (as a broken
cli_filter.lua would), rather than letting its checks be skipped.
--]]

local COLLOC = {
-- @@COLLOC_SETTINGS@@ (replaced at install time)
	estimator = "/usr/local/bin/colloc",
	timeout_s = 30,
	timeout_bin = "/usr/bin/timeout",
}

-- The site's own cli_filter.lua, embedded by `colloc admin install --chain-cli-filter`.
local SITE_CHAIN = nil
-- @@SITE_CHAIN@@

-- Loaded once, with this file: the site's globals stay its own; its entry points are
-- kept here and the globals given back to colloc's (defined below).
local SITE_HOOKS = { "slurm_cli_setup_defaults", "slurm_cli_pre_submit",
	"slurm_cli_post_submit" }
local site_fn, site_error = {}, nil
if SITE_CHAIN ~= nil then
	-- loadstring is Lua 5.1's; from 5.2 load takes a string (EL9's Slurm links Lua 5.4)
	local chunk, err = (loadstring or load)(SITE_CHAIN.text, "=" .. SITE_CHAIN.name)
	if chunk then
		local ok, lerr = pcall(chunk)
		if not ok then chunk, err = nil, lerr end
	end
	local any = false
	for _, name in ipairs(SITE_HOOKS) do
		if chunk and type(_G[name]) == "function" then
			site_fn[name] = _G[name]
			any = true
		end
		_G[name] = nil
	end
	if not any then
		site_error = tostring(err or "it defines no slurm_cli_* function")
		slurm.log_error("colloc: the chained cli_filter.lua %s did not load: %s",
			SITE_CHAIN.name, site_error)
	end
end

-- Run the site's function `name` first; returns its code when that is the answer.
local function run_site(name, ...)
	if SITE_CHAIN == nil then return nil end
	if site_error then
		slurm.log_error("colloc: the site's cli_filter.lua (run before colloc's) did not "
			.. "load: %s; please tell the administrators", site_error)
		return slurm.ERROR
	end
	local fn = site_fn[name]
	if not fn then return nil end
	local rc = fn(...)
	if type(rc) == "number" and rc ~= slurm.SUCCESS then return rc end
	return nil
end

local MAX_OUTPUT = 65536
local MAX_MIB = 16 * 1024 * 1024 -- as job_submit.lua

local function sh_quote(s)
	return "'" .. string.gsub(tostring(s), "'", "'\\''") .. "'"
end

local function fail(fmt, ...)
	slurm.log_error("colloc: " .. fmt, ...)
	return slurm.ERROR
end

local function json_int(text, key)
	return tonumber(string.match(text, '"' .. key .. '"%s*:%s*(%d+)') or "")
end

local function json_str(text, key)
	return string.match(text, '"' .. key .. '"%s*:%s*"([^"]*)"')
end

-- Run the estimator; returns (output, exit status).
local function run_estimator(argv)
	local parts = {}
	if COLLOC.timeout_bin ~= "" then
		parts[#parts + 1] = sh_quote(COLLOC.timeout_bin)
		parts[#parts + 1] = "-k 2"
		parts[#parts + 1] = tostring(COLLOC.timeout_s)
	end
	for i = 1, #argv do parts[#parts + 1] = sh_quote(argv[i]) end
	local cmd = table.concat(parts, " ") .. " </dev/null 2>&1; echo colloc-exit:$?"
	local p = io.popen(cmd, "r")
	if not p then return nil, -1 end
	local out = p:read(MAX_OUTPUT) or ""
	p:read("*a") -- drain
	p:close()
	local body, code = string.match(out, "^(.*)colloc%-exit:(%d+)%s*$")
	if not body then return out, -1 end
	return body, tonumber(code)
end

local function estimate(o)
	local summary = o["colloc"]
	-- The user's own override (tests, trying an estimator): harmless, since this
	-- filter runs as the user and job_submit.lua checks whatever arrives.
	local estimator = os.getenv("COLLOC_ESTIMATOR_COMMAND") or ""
	if estimator == "" then estimator = COLLOC.estimator end
	local argv = { estimator, "estimate", "--summary", summary }
	if o["colloc-batch-size"] then
		argv[#argv + 1] = "--batch-size"; argv[#argv + 1] = o["colloc-batch-size"]
	end
	if o["colloc-seq-len"] then
		argv[#argv + 1] = "--seq-len"; argv[#argv + 1] = o["colloc-seq-len"]
	end
	if o["colloc-optimizer"] then
		argv[#argv + 1] = "--optimizer"; argv[#argv + 1] = o["colloc-optimizer"]
	end
	if o["colloc-precision"] then
		argv[#argv + 1] = "--precision"; argv[#argv + 1] = o["colloc-precision"]
	end
	if o["colloc-attention"] then
		argv[#argv + 1] = "--attention"; argv[#argv + 1] = o["colloc-attention"]
	end
	argv[#argv + 1] = "--json"
	local out, code = run_estimator(argv)
	if code ~= 0 then
		local msg = string.match(out or "", "^%s*(.-)%s*$") or ""
		if code == 124 or code == 137 then
			msg = string.format("the estimate took longer than %d s", COLLOC.timeout_s)
		elseif code == 126 or code == 127 then
			msg = "cannot run the estimator " .. estimator .. " (" .. msg .. ")"
		end
		if msg == "" then msg = "estimator exited with status " .. tostring(code) end
		return nil, string.format("--colloc=%s: %s", summary, string.sub(msg, 1, 2000))
	end
	local json = string.match(out, "(%b{})")
	if not json then
		return nil, "--colloc=" .. summary .. ": the estimator printed no JSON estimate"
	end
	local e = {
		mib = json_int(json, "estimate_mib"),
		margin = json_int(json, "margin_mib") or 0,
		est = json_str(json, "estimator"),
		fp = json_str(json, "fingerprint"),
	}
	if not e.mib or not e.est or not e.fp then
		return nil, "--colloc=" .. summary .. ": the estimator's JSON lacks estimate_mib, "
			.. "estimator or fingerprint"
	end
	e.est = string.lower(e.est)
	e.fp = string.lower(e.fp)
	-- Only what job_submit.lua accepts goes into the record: nothing the estimator
	-- prints may add record syntax (a "," or "=" in the name or fingerprint).
	if not string.match(e.est, "^[a-z0-9._-]+$") or #e.est > 32
		or not string.match(e.fp, "^[0-9a-f]+$") or #e.fp > 64
		or e.mib < 1 or e.mib > MAX_MIB or e.margin > e.mib then
		return nil, "--colloc=" .. summary .. ": the estimator's JSON has an invalid "
			.. "estimate_mib, margin_mib, estimator name ([a-z0-9._-]{1,32}) or fingerprint "
			.. "(1-64 hex digits)"
	end
	return e, nil
end

function slurm_cli_setup_defaults(options, early_pass)
	return run_site("slurm_cli_setup_defaults", options, early_pass) or slurm.SUCCESS
end

-- How the --colloc* options combine. Checked here, not (only) in the SPANK plugin:
-- the plugin is loaded `optional` (a broken plugin must not fail every sbatch on the
-- cluster), and Slurm ignores an optional plugin's errors.
local EST_ARGS = { "colloc-batch-size", "colloc-seq-len", "colloc-optimizer",
	"colloc-precision", "colloc-attention" }

local function combination_error(o)
	local summary = o["colloc"]
	local has_summary = summary ~= nil and summary ~= "" and summary ~= "set"
	local est_arg = false
	for _, k in ipairs(EST_ARGS) do
		if o[k] ~= nil then est_arg = true end
	end
	if est_arg and not has_summary and not o["colloc-mem"] then
		return "--colloc-batch-size/--colloc-seq-len/--colloc-optimizer/--colloc-precision "
			.. "need --colloc=SUMMARY"
	end
	if has_summary and not o["colloc-mem"] and not o["colloc-batch-size"] then
		return "--colloc=SUMMARY needs --colloc-batch-size=N (or give the memory with "
			.. "--colloc-mem=SIZE)"
	end
	return nil
end

local function colloc_pre_submit(options, pack_offset)
	local sp = options["spank"]
	local o = sp and sp["colloc"]
	if type(o) ~= "table" then return slurm.SUCCESS end
	local bad = combination_error(o)
	if bad then return fail("%s", bad) end
	if o["colloc-mem"] then return slurm.SUCCESS end -- explicit size: nothing to estimate
	local summary = o["colloc"]
	-- bare --colloc shows up as "set": no summary, job_submit gives the default
	if summary == nil or summary == "" or summary == "set" then return slurm.SUCCESS end
	local e, err = estimate(o)
	if not e then return fail("%s", err) end
	local record = string.format("colloc-estimate:v1:mib=%d,margin=%d,est=%s,fp=%s",
		e.mib, e.margin, e.est, e.fp)
	local comment = options["comment"]
	if comment ~= nil and comment ~= "" then
		-- a re-run of the filter (het job component) must not stack records
		comment = string.gsub(comment, "^colloc%-estimate:%S*%s?", "")
		if comment ~= "" then record = record .. " " .. comment end
	end
	options["comment"] = record
	slurm.log_verbose("colloc: estimate for %s: %d MiB + %d MiB margin (%s)", summary, e.mib,
		e.margin, e.est)
	return slurm.SUCCESS
end

function slurm_cli_pre_submit(options, pack_offset)
	local rc = run_site("slurm_cli_pre_submit", options, pack_offset)
	if rc then return rc end
	return colloc_pre_submit(options, pack_offset)
end

function slurm_cli_post_submit(offset, job_id, step_id)
	return run_site("slurm_cli_post_submit", offset, job_id, step_id) or slurm.SUCCESS
end

return slurm.SUCCESS
