// vcsim for deploybot's tests: govmomi's simulator in vCenter (VPX) or ESX mode on
// 127.0.0.1 with TLS. Prints "URL <url>" once listening, then serves until SIGTERM.
//
// -username/-password make it refuse every other login.
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
	// vCenter's vAPI REST endpoints (/rest: sessions, tagging), as vcsim serves them;
	// VPX mode only, as a standalone ESXi host has none.
	_ "github.com/vmware/govmomi/vapi/simulator"
	"github.com/vmware/govmomi/vim25/types"
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
	// Without these vcsim accepts any non-empty user and password.
	username := flag.String("username", "", "the only user that may log in")
	password := flag.String("password", "", "that user's password")
	// More VMs per resource pool than the model's 2: an inventory of realistic size
	// for the benchmark and the tests that check lookups do not grow with it.
	machines := flag.Int("vm", 0, "VMs per resource pool (0: the model's default)")
	flag.Parse()

	model := simulator.VPX()
	if *esx {
		model = simulator.ESX()
	}
	if *machines > 0 {
		model.Machine = *machines
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
	markUplinks()
	model.Service.Listen = &url.URL{Host: "127.0.0.1:0"}
	if *username != "" {
		model.Service.Listen.User = url.UserPassword(*username, *password)
	}
	model.Service.TLS = new(tls.Config)
	// Serve the endpoints registered by the imports (the vAPI's /rest, VPX mode only).
	model.Service.RegisterEndpoints = true
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

// markUplinks marks each distributed switch's uplink portgroup as vCenter does
// (config.uplink, tag SYSTEM/DVS.UPLINKPG): vcsim 0.24 creates it unmarked, which
// would make it look like a portgroup for VMs.
func markUplinks() {
	for _, entity := range simulator.Map.All("DistributedVirtualPortgroup") {
		pg := entity.(*simulator.DistributedVirtualPortgroup)
		if strings.Contains(pg.Name, "-DVUplinks") {
			pg.Config.Uplink = types.NewBool(true)
			pg.Tag = append(pg.Tag, types.Tag{Key: "SYSTEM/DVS.UPLINKPG"})
		}
	}
}
