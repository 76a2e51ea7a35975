"""Starting a run from a trained model (`--init_from`): what PATH names (`locate`), loading its weights in low memory
(`load`), and the record of it in the run folder (`record`)."""
