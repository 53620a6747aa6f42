"""What any paged engine's KV cache needs from kvtier, with no engine import: an engine adapter
(``kvtier.integrations.vllm`` today) only translates its engine's hooks and specs into these
terms.

Scheduler side: ``groups`` (one class per kind of KV-cache group), ``layout`` (the engine's
groups as kvtier stores them), ``namespaces`` (the keys' namespaces of a request), ``hits`` (the
longest hit every group allows), ``lookups`` (a prompt's keys and hit), ``planner`` (the record
of each request and its load decision), ``saves`` (the save jobs of a step and of a finished
request's history), ``load_costs`` (load or recompute), ``jobs`` (what the workers are asked to
load and save). Worker side: ``context`` (what the loader and saver use of a worker), ``pages``
(the engine's KV tensors as pages, and the copies between pages and payloads), ``device_copy``
(the CUDA side of those copies), ``loader`` and ``saver``."""
