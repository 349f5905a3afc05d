"""Many processes, one database: which runner holds which job (`claims`: claims, epochs,
renewals, takeover), what happens to work a runner could not finish (`recovery`), and
whether the database answers (`storewatch`)."""
