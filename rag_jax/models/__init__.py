"""The towers: BERT/DPR encoders, BART, and BART warm-started from BERT."""
