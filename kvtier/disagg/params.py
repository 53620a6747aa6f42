"""The ``kv_transfer_params`` keys that ``pd-proxy`` and the connector exchange.

    proxy -> prefill instance   {PREFILL_PARAM: true}              "say what you saved"
    prefill instance -> proxy   {PREFILLED_PARAM: n}               n prompt tokens are on their way
    proxy -> decode instance    {PREFILLED_PARAM: n}               wait for them, then load them
"""

PREFILL_PARAM = "kvtier_prefill"
PREFILLED_PARAM = "kvtier_prefilled_tokens"
