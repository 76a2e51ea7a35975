"""Preference training (DPO): pairs of answers to one prompt, the reference's log-probabilities, the step's terms
in the log, validation on held-out pairs, and the reference precomputed in one streaming pass.

    collate      rows {prompt, chosen, rejected} → the two answers as unpacked sequences, chosen first
    reference    where the reference's log-probabilities come from: the adapters off, a frozen copy, or the rows
    log          the terms TRL's users read (rewards/chosen, rejected, accuracy, margin) and the stall at ln 2
    evaluation   the DPO loss, accuracy and margin on held-out pairs
    precompute   `lowmem dpo_reference`: the reference's log-probabilities written beside the rows

The loss itself is the model's (`lowmem.model.preference`), computed inside its forward.
"""
