"""What any paged engine's KV cache needs from kvtier, with no engine import: an engine adapter
(``kvtier.integrations.vllm`` today) only translates its engine's hooks and specs into these
terms. ``groups``: one class per kind of KV-cache group; ``planner``: the scheduler side's
record of each request and its load decision."""
