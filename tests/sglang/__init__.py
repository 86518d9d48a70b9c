

def full_push(engine):
    """The engine's ServerPush (weight_sync/server_push.py), attached on first use: the sync that pushes its weights
    and re-syncs a lost server from its host copy, as build_weight_sync makes it for a run."""
    from megatron_dapo.weight_sync.server_push import ServerPush

    return engine.weight_sync if engine.weight_sync is not None else ServerPush(engine)
