"""Who runs next and whether it fits: the tenant-fair queue (VTC), dispatch, and the KV-block admission gate."""
