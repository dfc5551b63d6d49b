"""The engine: paged KV block pool with a prefix cache, scheduler, model runner, models, sampling."""
