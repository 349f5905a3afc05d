"""Who may do what: which requests wait for an approver, who may decide and the decision
(`decisions`), and the audit of refused actions (`audit`)."""
