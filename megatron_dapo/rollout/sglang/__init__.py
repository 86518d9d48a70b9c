"""SGLang servers: launch, protocol, client engine, start-up choices."""
