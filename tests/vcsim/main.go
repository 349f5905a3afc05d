// vcsim for deploybot's tests: govmomi's simulator in vCenter (VPX) or ESX mode on
// 127.0.0.1 with TLS. Prints "URL <url>" once listening, then serves until SIGTERM.
//
// -cert/-key give it a certificate made by the tests (trustme): the built-in httptest
// certificate has a 1024-bit key that OpenSSL 3 refuses, and a CA of our own lets the
// tests keep TLS verification on. -delay Method=ms,... makes those calls slow.
package main

import (
	"crypto/tls"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/vmware/govmomi/simulator"
)

func fail(err error) {
	fmt.Fprintln(os.Stderr, "vcsim:", err)
	os.Exit(1)
}

func main() {
	esx := flag.Bool("esx", false, "simulate a standalone ESXi host instead of vCenter")
	certFile := flag.String("cert", "", "PEM certificate chain for TLS")
	keyFile := flag.String("key", "", "PEM private key for TLS")
	delays := flag.String("delay", "", "Method=milliseconds,... to slow those calls down")
	flag.Parse()

	model := simulator.VPX()
	if *esx {
		model = simulator.ESX()
	}
	model.DelayConfig.MethodDelay = map[string]int{}
	for _, item := range strings.FieldsFunc(*delays, func(r rune) bool { return r == ',' }) {
		method, ms, _ := strings.Cut(item, "=")
		value, err := strconv.Atoi(ms)
		if err != nil {
			fail(err)
		}
		model.DelayConfig.MethodDelay[method] = value
	}
	defer model.Remove()
	if err := model.Create(); err != nil {
		fail(err)
	}
	model.Service.Listen = &url.URL{Host: "127.0.0.1:0"}
	model.Service.TLS = new(tls.Config)
	if *certFile != "" {
		pair, err := tls.LoadX509KeyPair(*certFile, *keyFile)
		if err != nil {
			fail(err)
		}
		model.Service.TLS.Certificates = []tls.Certificate{pair}
	}
	// No server.Close() at the end: it waits for every open long poll to finish.
	server := model.Service.NewServer()
	fmt.Printf("URL %s\n", server.URL)

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
