"""The API adapter: the Tinker REST contract on one side, Temporal and the claim-check store on the other.

It keeps nothing in memory that matters: every fact lives in Temporal or the store, so a restarted adapter answers
every future it was asked before.
"""
