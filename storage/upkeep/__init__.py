"""Tending the store after it is written: closed days merged (`merge`), what merges leave
tidied (`cleanup`), a prune's cutoff (`cutoff`), and `overnight check` (`check`)."""
