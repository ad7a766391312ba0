"""Speculative proposers: cheap guesses of a request's next tokens, verified by the target model
in one pass over the cache (kvserve.runner.sampler.Sampler.verify); rejected guesses are taken
back (Scheduler.update trims their K/V).

  ngram  prompt lookup: the tokens that followed the last n tokens earlier in the context
  draft  a smaller model with the same vocabulary, with its own paged cache, rolled back with
         the target
"""
