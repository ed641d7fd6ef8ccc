"""`fs.estimate`: a trace and the cost model put together into peak memory and step time."""
