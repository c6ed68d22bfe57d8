"""The router process: tokenizes, mirrors every slot, picks slots, supervises workers."""
