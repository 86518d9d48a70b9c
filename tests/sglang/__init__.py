

def full_push(engine, mode: str | None = None):
    """The engine's full push by the transport `mode` (weight_sync/transports/, as build_weight_sync makes it for
    a run), attached on first use: the sync that pushes its weights and re-syncs a lost server from its host copy.
    `mode` None: the sync already attached, else "tensor". A test that moves one engine to another transport gets
    a new sync: the previous one is closed and detached (a run never does: its transport is chosen once)."""
    from megatron_dapo.weight_sync.transports import transport

    if mode is None and engine.weight_sync is not None:
        return engine.weight_sync
    cls = transport(mode or "tensor")
    if type(engine.weight_sync) is cls:
        return engine.weight_sync
    if engine.weight_sync is not None:
        engine.weight_sync.close()
        engine.weight_sync = None
    return cls(engine)
