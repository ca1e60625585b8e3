"""Quality evaluation of the serving formats: `jaxserve.eval.quality` (`jaxserve eval-quality`)."""
